"""compressed-tensors checkpoints grouped out of activation order (``actorder: group``, a
``weight_g_idx`` per weight), which ``tests/duet/test_packed_checkpoints.py`` checks against
transformers and compressed-tensors' own dequantization: what is damaged about one."""

from __future__ import annotations

import importlib.util

import pytest
from safetensors.torch import load_file

from duet import LLM
from tests.duet.test_packed_checkpoints import checkpoints  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="compressed-tensors is not installed")


@pytest.mark.slow
def test_a_group_ordered_checkpoint_without_its_g_idx_is_damaged(checkpoints, tmp_path):
    """``actorder: group`` gives each weight a ``weight_g_idx``; one missing is damage, named."""
    import shutil

    from safetensors.torch import save_file

    from duet.errors import DamagedCheckpointError

    path, _ = checkpoints("llama-w4-g32-group-order")
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    state = load_file(str(damaged / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight_g_idx"]
    save_file(state, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DamagedCheckpointError, match=r"down_proj\.weight_g_idx is missing"):
        LLM(model=str(damaged), num_kv_blocks=16)
