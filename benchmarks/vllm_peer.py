"""vLLM's side of ``duet bench offline --peer vllm``: run in vLLM's own virtual environment (it
imports nothing of duet's), from a directory outside duet's checkout, on the prompts and the
weights duet measured, and print the seconds each measure took as one JSON line.

    python vllm_peer.py MODEL_DIR PROMPTS_JSON --dtype float32 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("prompts", help="JSON: batch (lists of token ids), prefill (one list), output_tokens")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with open(args.prompts) as file:
        work = json.load(file)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=2048, max_num_seqs=len(work["batch"]), seed=0)
    decode = SamplingParams(temperature=0.0, max_tokens=work["output_tokens"], ignore_eos=True)
    one_token = SamplingParams(temperature=0.0, max_tokens=1)

    def timed(prompts, params) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts], params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return best

    timed(work["batch"][:4], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    seconds = {
        "batch": timed(work["batch"], decode),
        "single": timed(work["batch"][:1], decode),
        "prefill": timed([work["prefill"]], one_token),
    }
    print("VLLM_SECONDS " + json.dumps(seconds), flush=True)


if __name__ == "__main__":
    main()
