"""``duet bench serve``'s summary: goodput over the whole run, and the drain that ends it."""

from __future__ import annotations

import pytest

from duet.benchmarks.serve import RequestResult, format_table, summarise


def test_the_summary_splits_the_run_into_arrivals_and_the_drain_after_the_last():
    """Guards the comparison of PD with colocation at 4 req/s, where every request met its SLO in
    both and the goodputs still differed by 3%: the layouts differed only in how long they took to
    finish what was left after the last arrival, which the summary did not show."""
    results = [
        RequestResult(ok=True, sent_s=0.0, ttft=0.5, e2e=1.5, output_tokens=11),
        RequestResult(ok=True, sent_s=1.0, ttft=2.5, e2e=3.0, output_tokens=11),  # past the 2 s TTFT target
        RequestResult(ok=False, sent_s=2.0, error="HTTP 503"),
    ]
    summary = summarise("pd", "random", results, duration=4.5, slo_ttft=2.0, slo_tpot=0.2)
    assert summary.drain_s == pytest.approx(2.5)
    assert summary.goodput == pytest.approx(1 / 4.5) and summary.request_throughput == pytest.approx(2 / 4.5)
    assert [row["sent_s"] for row in summary.requests] == [0.0, 1.0, 2.0]
    assert [row["ok"] for row in summary.requests] == [True, True, False]
    assert summary.requests[0]["tpot_ms"] == pytest.approx(100.0) and summary.requests[1]["ttft_ms"] == pytest.approx(2500.0)
    header, row = format_table([summary]).splitlines()
    assert "drain s" in header and "   2.50 " in row


def test_autoscale_phases_take_a_rate_or_a_closed_loop():
    from duet.benchmarks.autoscale import Phase, parse_phases

    assert parse_phases("prompts:120:c6:1400:1,gen:60:2.5:32:256") == [
        Phase("prompts", 120.0, 0.0, 1400, 1, concurrency=6), Phase("gen", 60.0, 2.5, 32, 256),
    ]


def test_autoscale_runs_are_compared_by_slo_attainment_and_replica_seconds(tmp_path):
    """Replica-seconds integrate the pools' running replicas between samples, cut at the phase's
    bounds; the planned run's config is the reactive one with each autoscaled pool's profile."""
    from pathlib import Path

    import yaml

    from duet.benchmarks.autoscale import Sample, Sent, phase_figures, planned_config, replica_seconds, totals
    from duet.benchmarks.serve import RequestResult

    samples = [Sample(0.0, {"prefill": 1, "decode": 1}, {}), Sample(10.0, {"prefill": 2, "decode": 1}, {}), Sample(20.0, {"prefill": 1}, {})]
    assert replica_seconds(samples, 0.0, 20.0) == 2 * 10 + 3 * 10
    assert replica_seconds(samples, 5.0, 15.0) == 2 * 5 + 3 * 5

    def sent(ttft: float, ok: bool = True) -> Sent:
        return Sent("p", 1.0, RequestResult(ok=ok, ttft=ttft, e2e=ttft + 0.3, output_tokens=4, error="" if ok else "boom"))  # TPOT 0.1 s

    figures = phase_figures([sent(0.5), sent(3.0), sent(0.5), sent(0.5, ok=False)], samples, {"p": (0.0, 20.0)}, 2.0, 0.2)
    assert figures["p"]["slo_attainment"] == 0.5 and figures["p"]["failed"] == 1 and figures["p"]["replica_seconds"] == 50
    assert totals(figures) == {"requests": 4, "failed": 1, "slo_attainment": 0.5, "replica_seconds": 50}

    profile = tmp_path / "profile.json"
    written = yaml.safe_load(Path(planned_config("configs/autoscale.yaml", str(profile), tmp_path / "planned.yaml")).read_text())
    args = written["applications"][0]["args"]
    assert args["prefill"]["autoscaling_config"]["profile"] == args["decode"]["autoscaling_config"]["profile"] == str(profile)
    assert args["prefill"]["autoscaling_config"]["max_replicas"] == 2  # the rest as it was


def test_a_cut_off_sharegpt_file_keeps_its_whole_conversations():
    """The PyPI package's ShareGPT JSON ends in the middle of an entry: the list is closed after
    the last whole one."""
    from duet.benchmarks.sharegpt import whole_entries

    whole = '[\n  {"id": "a", "conversations": []},\n  {"id": "b", "conversations": [{"from": "human", "value": "x]"}]}\n]'
    assert whole_entries(whole) == ([{"id": "a", "conversations": []}, {"id": "b", "conversations": [{"from": "human", "value": "x]"}]}], True)
    cut = whole[: whole.index('"value"') + 12]
    assert whole_entries(cut) == ([{"id": "a", "conversations": []}], False)


def test_multiturn_sessions_send_the_recorded_history_through_the_chat_template(tiny_tokenizer_dir):
    """Turn k's prompt is turns 1..k-1 (the recorded replies as the assistant's) and message k,
    rendered as the chat endpoint renders them; its output is the recorded reply's length, capped;
    a session stops before the turn that would not fit the context."""
    from duet.benchmarks.workloads import sharegpt_sessions
    from duet.router.tokenizer import RouterTokenizer

    tokenizer = RouterTokenizer(tiny_tokenizer_dir)
    turns = [("Hi there", "Hello! " * 3), ("Tell me a long story", "Once " * 200), ("And then?", "The end.")]
    conversation = [{"from": who, "value": text} for message, reply in turns for who, text in (("human", message), ("gpt", reply))]
    (session,) = sharegpt_sessions(tokenizer, [conversation, [{"from": "gpt", "value": "no human first"}]], 1, 3, 64, 10_000, 0)
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! " * 3}, {"role": "user", "content": "Tell me a long story"}]
    assert [turn.prompt for turn in session] == [tokenizer.encode_chat(history[:1]), tokenizer.encode_chat(history), session[2].prompt]
    assert session[2].prompt[: len(session[1].prompt)] == session[1].prompt  # each turn extends the last
    assert [turn.output_len for turn in session] == [len(tokenizer.encode("Hello! " * 3, add_special_tokens=False)), 64, 4]
    short = sharegpt_sessions(tokenizer, [conversation], 1, 3, 64, len(session[1].prompt) + 63, 0)
    assert [len(s) for s in short] == [1]


def test_a_generated_history_resends_the_servers_replies_where_the_recorded_ones_stood(tiny_tokenizer_dir):
    """With ``--history generated`` a later turn is the last prompt sent, the reply the server
    generated, and what the template puts after a reply (its end of turn, the next message, the
    assistant's start): token for token the recorded prompt with the generated reply in place of
    the recorded one. Where the template does not put the reply there token for token, the turn
    is sent as recorded."""
    from duet.benchmarks.workloads import _after_reply, sharegpt_sessions
    from duet.router.tokenizer import RouterTokenizer

    tokenizer = RouterTokenizer(tiny_tokenizer_dir)
    turns = [("Hi there", "Hello, how are you?"), ("Tell me a story", "Once upon a time."), ("And then?", "The end.")]
    conversation = [{"from": who, "value": text} for message, reply in turns for who, text in (("human", message), ("gpt", reply))]
    (session,) = sharegpt_sessions(tokenizer, [conversation], 1, 3, 64, 10_000, 0)
    assert session[0].after_reply is None and all(turn.after_reply for turn in session[1:])
    for last, turn, (_, reply) in zip(session, session[1:], turns):
        assert turn.prompt == last.prompt + tokenizer.encode(reply, add_special_tokens=False) + turn.after_reply
        assert turn.sent_prompt(None) == turn.prompt
    generated = [7, 8, 9]
    sent = session[1].sent_prompt((session[0].prompt, generated))
    other = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": tokenizer.decode(generated)}, {"role": "user", "content": "Tell me a story"}]
    assert sent == session[0].prompt + generated + session[1].after_reply
    assert tokenizer.decode(sent) == tokenizer.decode(tokenizer.encode_chat(other))  # the chat a client would send
    assert _after_reply([1, 2, 3, 4], [1], [2]) == [3, 4] and _after_reply([1, 5, 3, 4], [1], [2]) is None


def test_later_turns_are_summarised_apart_with_their_prefix_hits():
    results = [
        RequestResult(ok=True, turn=0, ttft=0.4, e2e=1.0, output_tokens=5, prompt_tokens=100, cached_tokens=0),
        RequestResult(ok=True, turn=1, ttft=0.1, e2e=0.5, output_tokens=5, prompt_tokens=200, cached_tokens=150),
        RequestResult(ok=True, turn=2, ttft=0.2, e2e=0.5, output_tokens=5, prompt_tokens=300, cached_tokens=250),
    ]
    turns = summarise("pd", "multiturn", results, duration=3.0, slo_ttft=2.0, slo_tpot=0.2).turns
    assert turns["first"] == {"requests": 1, "ttft_p50_ms": pytest.approx(400.0), "prefix_hit_rate": 0.0}
    assert turns["later"]["requests"] == 2 and turns["later"]["prefix_hit_rate"] == pytest.approx(400 / 500)


def test_sessions_are_plotted_by_turn(tmp_path, capsys):
    from duet.benchmarks.serve_plots import plot_kv, plot_turns

    results = [
        RequestResult(ok=True, turn=turn, ttft=0.1 * (turn + 1), e2e=1.0, output_tokens=5, prompt_tokens=100, cached_tokens=30 * turn)
        for turn in range(3)
    ]
    summary = summarise("pd", "multiturn", results, duration=3.0, slo_ttft=2.0, slo_tpot=0.2)
    plot_turns([summary], str(tmp_path / "turns.png"))
    assert (tmp_path / "turns.png").stat().st_size > 0
    assert "turns plot written to" in capsys.readouterr().out
    summary.kv_timeline = [{"t": float(t), "pool": {"prefill": 10.0 * t}, "tier": {"prefill": 5.0 * t}} for t in range(4)]
    plot_kv([summary], str(tmp_path / "kv.png"))
    assert (tmp_path / "kv.png").stat().st_size > 0


def test_kv_samples_sum_each_stages_replicas_from_the_metrics():
    import asyncio

    from duet.benchmarks.serve_plots import queue_balance, watch_kv

    text = "\n".join([
        'duet:kv_cache_blocks{model_name="m",stage="prefill",replica="a"} 100.0',
        'duet:kv_cache_blocks{model_name="m",stage="decode",replica="b"} 200.0',
        'duet:kv_cache_blocks{model_name="m",stage="decode",replica="c"} 200.0',
        'vllm:kv_cache_usage_perc{model_name="m",stage="prefill",replica="a"} 0.5',
        'vllm:kv_cache_usage_perc{model_name="m",stage="decode",replica="b"} 0.25',
        'vllm:kv_cache_usage_perc{model_name="m",stage="decode",replica="c"} 0.5',
        'duet:kv_offload_blocks{model_name="m",stage="prefill",replica="a"} 30.0',
    ])

    queued = iter([{"prefill": [("p1", 300), ("p2", 100)], "decode": [("d1", 0)]}, {"prefill": [("p1", 100), ("p2", 300)], "decode": [("d1", 0)]}])

    class Client:
        async def get(self, url, timeout):
            if url.endswith("/metrics"):
                return type("Response", (), {"text": text})()
            pools = next(queued)
            if pools["prefill"][0][1] == 100:  # the second status read: the last sample
                stop.set()
            body = {pool: {"stats": [{"replica_id": replica, "prompt_tokens_pending": tokens} for replica, tokens in stats]} for pool, stats in pools.items()}
            return type("Response", (), {"status_code": 200, "json": lambda self: {"pools": body}})()

    samples, stop = [], asyncio.Event()
    asyncio.run(watch_kv(Client(), "http://127.0.0.1:1", 0.0, samples, stop, interval_s=0.01))
    assert len(samples) == 2
    assert samples[0]["pool"] == {"prefill": 50.0, "decode": 150.0} and samples[0]["tier"] == {"prefill": 30.0, "decode": 0.0}
    assert samples[1]["queued"] == {"prefill": {"p1": 100, "p2": 300}, "decode": {"d1": 0}}
    # Each replica's mean over the run: 200 and 200 queued, even; decode queued nothing.
    assert queue_balance(samples) == {"prefill": 1.0}
    assert queue_balance(samples[:1]) == {"prefill": 1.5}  # 300 against a mean of 200


def _write_trace(path, records) -> None:
    import json

    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_a_trace_replays_its_shared_prefixes_and_lengths_scaled_to_the_context(tmp_path):
    """Mooncake's format: a hash id is one block of the prompt, the same tokens wherever it
    appears; lengths are scaled by one factor so that the longest request fits the context."""
    from duet.benchmarks.workloads import SAFE_TOKEN_RANGE, trace_sessions

    trace = tmp_path / "trace.jsonl"
    _write_trace(trace, [
        {"timestamp": 5000, "input_length": 2000, "output_length": 48, "hash_ids": [7, 8, 9, 10]},
        {"timestamp": 1000, "input_length": 3000, "output_length": 96, "hash_ids": [7, 8, 11, 12, 13, 14]},  # the first by time
        {"timestamp": 2000, "input_length": 700, "output_length": 16, "hash_ids": [20, 21]},
        {"timestamp": 9000, "input_length": 100, "output_length": 8, "hash_ids": []},  # past --num-requests
    ])
    sessions = trace_sessions(trace, num=3, max_context=1548, seed=3)
    (first,), (second,), (third,) = sessions
    scale = 1548 / 3096  # the longest request (of three, the 90th percentile), 3,000 + 96 tokens, fills the context
    assert [len(first.prompt), len(second.prompt), len(third.prompt)] == [int(3000 * scale), int(700 * scale), int(2000 * scale)]
    assert [first.output_len, second.output_len, third.output_len] == [48, 8, 24]
    assert [first.at_s, second.at_s, third.at_s] == [0.0, 1.0, 4.0]
    block = int(512 * scale)  # blocks 7 and 8 are shared; 11 and 9 are not
    assert first.prompt[: 2 * block] == third.prompt[: 2 * block]
    assert first.prompt[2 * block : 3 * block] != third.prompt[2 * block : 3 * block]
    assert second.prompt[:block] != first.prompt[:block]
    assert all(SAFE_TOKEN_RANGE[0] <= token < SAFE_TOKEN_RANGE[1] for turns in sessions for token in turns[0].prompt)
    assert trace_sessions(trace, num=3, max_context=1548, seed=3) == sessions  # a seed gives the same tokens
    assert trace_sessions(trace, num=3, max_context=1548, seed=4)[0][0].prompt != first.prompt  # another, fresh ones
    short = trace_sessions(trace, num=3, max_context=8192, seed=3)  # room for all: nothing scaled
    assert [len(turns[0].prompt) for turns in short] == [3000, 700, 2000] and short[0][0].output_len == 96
    cut = trace_sessions(trace, num=3, max_context=1000, seed=3, scale=1.0)  # too long: outputs kept, prompts cut
    assert [(len(turns[0].prompt), turns[0].output_len) for turns in cut] == [(904, 96), (700, 16), (952, 48)]
    assert cut[0][0].prompt[:512] == short[0][0].prompt[:512]  # the start of the prompt is kept


def test_a_trace_arrives_at_its_own_times_scaled_to_the_mean_rate_asked():
    from duet.benchmarks.workloads import TurnSpec, arrival_times, session_arrivals

    traced = [[TurnSpec([1000], 4, at_s)] for at_s in (0.0, 1.0, 4.0, 10.0)]
    assert session_arrivals(traced, 0.3, seed=1) == pytest.approx([0.0, 1.0, 4.0, 10.0])  # its own mean rate: 3 gaps in 10 s
    assert session_arrivals(traced, 0.6, seed=1) == pytest.approx([0.0, 0.5, 2.0, 5.0])
    assert session_arrivals(traced, 0, seed=1) == [0.0] * 4
    poisson = [[TurnSpec([1000], 4)] for _ in range(5)]
    assert session_arrivals(poisson, 2.0, seed=9) == arrival_times(5, 2.0, seed=9)


def test_the_trace_workload_asks_for_its_file():
    import argparse

    from duet.benchmarks.serve import add_load_arguments, chosen_workloads

    parser = argparse.ArgumentParser()
    add_load_arguments(parser)
    with pytest.raises(SystemExit):
        chosen_workloads(parser, parser.parse_args(["--workloads", "random,trace"]))
    assert chosen_workloads(parser, parser.parse_args(["--workloads", "trace", "--trace", "t.jsonl"])) == ["trace"]
