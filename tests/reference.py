"""transformers as the correctness oracle: greedy tokens and how close each choice was."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

# A divergence from transformers is accepted only where its top-2 logits are this close.
NEAR_TIE = 1e-3


@dataclass
class Reference:
    token_ids: list[int]
    top2_gaps: list[float]  # logit(best) - logit(second) at each generated position


def hf_greedy(
    model_dir,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype=torch.float32,
    gguf_file: str | None = None,
    processes: int = 1,
    prepare=None,
) -> list[Reference]:
    """transformers ``generate(do_sample=False)`` one prompt at a time (no padding effects), on the
    checkpoint in ``model_dir`` (its GGUF file ``gguf_file``, read by transformers' own reader).

    ``processes`` > 1 shares the prompts out to that many fresh processes of one torch thread
    each (at most one a core): transformers' steps on a model of SmolLM2's size are bound by
    Python's overhead, not by its threads (on a 2-core EPYC one thread steps as fast as two, and
    two processes of one thread each step as fast as one alone), so the references come in about
    the time of one process's share plus a few seconds to start them. ``prepare`` (in this
    process only) is called with the loaded model before it generates."""
    processes = min(processes, len(prompts), os.cpu_count() or 1)
    if processes > 1 and prepare is None:
        return _in_processes(str(model_dir), prompts, max_new_tokens, dtype, gguf_file, processes)
    from transformers import AutoModelForCausalLM

    kwargs = {} if gguf_file is None else {"gguf_file": gguf_file}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kwargs).eval()
    if prepare is not None:
        prepare(model)
    references = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            gaps = []
            for logits in out.scores:
                top2 = torch.topk(logits[0].float(), 2).values
                gaps.append(float(top2[0] - top2[1]))
            references.append(Reference(tokens, gaps))
    return references


def _in_processes(model_dir: str, prompts, max_new_tokens, dtype, gguf_file, processes: int) -> list[Reference]:
    """``hf_greedy`` over ``processes`` spawned processes (not forked: this one's OpenMP pool
    would not survive a fork), each given every ``processes``-th prompt by length, so that their
    shares take about as long."""
    order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
    shares = [order[start::processes] for start in range(processes)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=processes, mp_context=context) as pool:
        futures = [
            pool.submit(_share, model_dir, [prompts[index] for index in share], max_new_tokens, dtype, gguf_file) for share in shares
        ]
        results = [future.result() for future in futures]
    references: list[Reference | None] = [None] * len(prompts)
    for share, result in zip(shares, results):
        for index, reference in zip(share, result):
            references[index] = reference
    return references


def _share(model_dir: str, prompts, max_new_tokens, dtype, gguf_file) -> list[Reference]:
    torch.set_num_threads(1)
    return hf_greedy(model_dir, prompts, max_new_tokens, dtype, gguf_file)


def compare_to_reference(got: list[int], reference: Reference, label: str) -> str | None:
    """None when identical; a note when they split at a near-tie; AssertionError otherwise."""
    for position, (ours, theirs) in enumerate(zip(got, reference.token_ids)):
        if ours != theirs:
            gap = reference.top2_gaps[position]
            assert gap < NEAR_TIE, (
                f"{label}: token {position} is {ours}, transformers gives {theirs} "
                f"with a top-2 logit gap of {gap:.2e} (not a near-tie)"
            )
            return f"{label}: split from transformers at token {position} where its top-2 gap is {gap:.1e}"
    assert len(got) == len(reference.token_ids), f"{label}: {len(got)} tokens, transformers {len(reference.token_ids)}"
    return None


def check_outputs(outputs, references: list[Reference], label: str) -> list[list[int]]:
    """Each request's tokens (``RequestOutput``s, as ``LLM.generate`` gives them) against its
    reference (``compare_to_reference``); the tokens."""
    tokens = [output.outputs[0].token_ids for output in outputs]
    assert len(tokens) == len(references)
    for index, (got, reference) in enumerate(zip(tokens, references)):
        assert compare_to_reference(got, reference, f"{label}, prompt {index}") is None
    return tokens
