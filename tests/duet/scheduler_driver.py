"""A fake runner for the real Scheduler, step by step (``tests/duet/test_scheduler*.py``): it
samples one token for each request whose computed plus scheduled tokens reach its
``num_tokens`` (the end of its prompt, or a decode step), like ``ModelRunner``."""

from collections.abc import Callable

from duet.outputs import RunnerOutput, SchedulerOutput
from duet.request import Request
from duet.sampling_params import SamplingParams
from duet.scheduler import Scheduler

EOS = 2
TOKEN = 7  # what the fake runner samples unless a test says otherwise


def new_request(request_id: str, prompt: list[int] | int, **params) -> Request:
    """A request; an int prompt means that many tokens, distinct per request id so they never share a prefix."""
    if isinstance(prompt, int):
        base = 1000 * (1 + sum(map(ord, request_id)))
        prompt = list(range(base, base + prompt))
    params.setdefault("max_tokens", 16)
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=EOS)


def step(scheduler: Scheduler, sample: Callable[[Request], int] = lambda request: TOKEN) -> SchedulerOutput:
    """One engine step with a fake runner that samples ``sample(request)`` where a real one would."""
    output = scheduler.schedule()
    request_ids, sampled = [], []
    for request_id, num_scheduled in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        reaches_end = request.num_computed_tokens + num_scheduled >= request.num_tokens
        request_ids.append(request_id)
        sampled.append([sample(request)] if reaches_end else [])
    scheduler.update_from_output(output, RunnerOutput(request_ids, sampled))
    return output


def run_until_done(scheduler: Scheduler, max_steps: int = 100, **kwargs) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "scheduler made no progress"
        outputs.append(step(scheduler, **kwargs))
    outputs.append(step(scheduler, **kwargs))  # delivers the last finished ids to the runner
    return outputs


def scripted(tokens_by_request: dict[str, list[int]]) -> Callable[[Request], int]:
    """A sampler that returns each request's tokens in order."""
    iterators = {request_id: iter(tokens) for request_id, tokens in tokens_by_request.items()}
    return lambda request: next(iterators[request.request_id])
