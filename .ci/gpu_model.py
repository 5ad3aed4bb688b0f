"""A checkpoint of SmolLM2-135M-Instruct's shape with random weights, made by transformers (the
real weights cannot travel to the device machine): ``python gpu_model.py CONFIG_DIR OUT_DIR``."""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

source, target = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.bfloat16)
model.save_pretrained(target)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(source / name, target / name)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters of random weights in {target}")
