"""An admitted run's deltas delivered to its client: one JSON body, or an SSE stream whose
status waits for the first output (so that a request failed before it gets its error's status,
as unstreamed). Either way the run's admission is released when its sequences end. The body and
chunks are built as the completions and chat endpoints answer; a ``Form`` writes them out (as
they are, or as another API's: ``duet.router.responses_output``) without parsing them again."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from fastapi.responses import JSONResponse, Response, StreamingResponse

from duet.router.admission import Admitted
from duet.router.errors import api_error_from
from duet.router.responses import ResponseBuilder, best_choices, error_body, sse
from duet.router.run import Run


class Form:
    """How the answer goes out: as the completions and chat endpoints write it. Another API's
    form overrides these (one instance a request: a stream's form may keep state)."""

    def whole(self, payload: dict) -> dict:
        """An unstreamed answer's body."""
        return payload

    def opening(self) -> list[str]:
        """The SSE events before a stream's first chunk."""
        return []

    def chunk(self, payload: dict) -> list[str]:
        """One chunk's SSE events (a usage chunk, or an error body after a failure, included)."""
        return [sse(payload)]

    def closing(self) -> list[str]:
        """The SSE events after the last chunk."""
        return [sse("[DONE]")]


async def respond(run: Run, builder: ResponseBuilder, body, admitted: Admitted, form: Form | None = None) -> Response:
    """``body``'s response to ``run``, written by ``form`` (the endpoints' own by default):
    streamed where it asks, else whole."""
    form = form or Form()
    if body.stream:
        # The status goes out with the first chunk: wait for the first output, so that a
        # request refused or failed before it (a bad token id, no room in time) gets its
        # error's status and Retry-After, as unstreamed, not a 200 and an error event.
        deltas = run.deltas()
        try:
            first = await anext(deltas, None)
        except BaseException as error:
            admitted.release()
            await deltas.aclose()
            if isinstance(error, Exception):
                raise api_error_from(error) from None
            raise
        return StreamingResponse(_stream(run, deltas, first, builder, body.include_usage, admitted, form), media_type="text/event-stream")
    try:
        async with aclosing(run.deltas()) as deltas:
            async for _ in deltas:
                pass
    except Exception as error:
        raise api_error_from(error) from None
    finally:
        admitted.release()
    choices = run.choices if body.num_sequences == body.n else best_choices(run.choices, body.n, body.num_sequences)
    # Off the event loop: with logprobs and an echoed prompt the body detokenizes every token
    # and alternative; an 8,192-token prompt with 20 alternatives took 0.39 s to build and
    # 0.25 s to write as JSON (Intel Xeon, model 167), time every other stream waited for.
    return await asyncio.to_thread(lambda: JSONResponse(form.whole(builder.response(choices, run.usage(builder)))))


async def _stream(run: Run, deltas, first, builder: ResponseBuilder, include_usage: bool, admitted: Admitted, form: Form):
    """The SSE body: ``first`` (the first of ``run``'s ``deltas``, None if it had none), then the rest."""
    for event in form.opening():
        yield event
    text_offsets = [0] * len(run.choices)
    started = [False] * len(run.choices)
    try:
        async with aclosing(deltas):
            item = first
            while item is not None:
                index, delta = item
                args = (index, delta, not started[index], text_offsets[index])
                if builder.carries_prompt(delta, not started[index]):  # built off the loop, as a whole body is
                    chunk = await asyncio.to_thread(builder.chunk, *args)
                else:
                    chunk = builder.chunk(*args)
                for event in form.chunk(chunk):
                    yield event
                started[index] = True
                text_offsets[index] += len(chunk["choices"][0].get("text", delta.text))  # an echoed prompt's included
                item = await anext(deltas, None)
        if include_usage:
            # Reasoning is counted by the text of each token (``duet.reasoning``): 4.7 ms for
            # 3,600 tokens (AMD EPYC), off the loop.
            usage = await asyncio.to_thread(run.usage, builder) if builder.reasoning_mode else run.usage(builder)
            for event in form.chunk(builder.usage_chunk(usage)):
                yield event
    except Exception as error:  # noqa: BLE001 - the status is sent; report in the stream
        api_error = api_error_from(error)
        for event in form.chunk(error_body(api_error.message, api_error.error_type, api_error.param, api_error.status)):
            yield event
    finally:
        admitted.release()
    for event in form.closing():
        yield event
