"""Checkpoint export (angel_ptm/checkpoint/export.py): the model's state_dict as one safetensors file, tied
weights, buffers and tensors without elements included; a HuggingFace model's export loads with from_pretrained."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import angel_ptm

from test_checkpoint import CASES, batches, config, step


# --- export -------------------------------------------------------------------------------------------------------
def test_export_writes_the_models_state_dict_as_safetensors_tied_weights_and_buffers_included(tmp_path):
    from safetensors.torch import load_file

    from angel_ptm import cli

    build, _, loss_fn = CASES["gpt"]  # the GPT ties its output projection to the embedding
    engine = angel_ptm.initialize(build(), config(tmp_path, "a", dtype="bfloat16", staleness=1))
    try:
        for batch in batches("gpt", 3):
            step(engine, loss_fn, batch)
        engine.save_checkpoint(tmp_path / "run" / "checkpoints" / "step-3", extra={"step": 3})
        engine.flush()
        expected = {k: v.clone() for k, v in engine.state_dict().items()}  # fp32 masters
    finally:
        engine.close()
    assert cli.main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "out" / "model.safetensors")]) == 0
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key
    plain = build()
    plain.load_state_dict(weights)  # strict: every key of the plain model
    assert cli.main(["export", str(tmp_path / "run" / "checkpoints" / "step-3"), "-o",
                     str(tmp_path / "bf16.safetensors"), "--dtype", "bfloat16"]) == 0
    assert load_file(tmp_path / "bf16.safetensors")["tok_embeddings.weight"].dtype == torch.bfloat16


class WithEmptyTensors(nn.Module):
    """A model with a parameter and a buffer that have no elements (they lie on no page)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.unused = nn.Parameter(torch.zeros(0, 4))
        self.register_buffer("empty", torch.zeros(0))

    def forward(self, x):
        return self.body(x).square().mean() + self.unused.sum()


def test_tensors_without_elements_round_trip_and_export_with_their_shapes(tmp_path):
    from safetensors.torch import load_file

    from angel_ptm.checkpoint.export import export_weights

    torch.manual_seed(0)
    engine = angel_ptm.initialize(WithEmptyTensors(), config(tmp_path, "a"))
    x = torch.randn(3, 4)
    try:
        engine.backward(engine(x))
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
        expected = {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()
    fresh = angel_ptm.initialize(WithEmptyTensors(), config(tmp_path, "b"))
    try:
        fresh.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    finally:
        fresh.close()
    export_weights(tmp_path / "ckpt", tmp_path / "w.safetensors")
    weights = load_file(tmp_path / "w.safetensors")
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    WithEmptyTensors().load_state_dict(weights)
    # an output path that cannot be a file: a one-line CheckpointError (a raw FileExistsError traceback came), and
    # nothing is left behind
    from angel_ptm.errors import CheckpointError

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match="export: cannot write .*a_file"):
        export_weights(tmp_path / "ckpt", tmp_path / "a_file" / "w.safetensors")
    with pytest.raises(CheckpointError, match="is a directory: name the .safetensors file"):
        export_weights(tmp_path / "ckpt", tmp_path)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_huggingface_models_export_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 16))
    engine = angel_ptm.initialize(model, config(tmp_path, "a", placement="device"))
    try:
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
        engine.eval()
        with torch.no_grad():
            expected = engine(ids).logits
    finally:
        engine.close()
    out = tmp_path / "hf"
    from angel_ptm.checkpoint.export import export_weights

    assert export_weights(tmp_path / "ckpt", out / "model.safetensors")["config"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-5)


def test_an_export_of_a_corrupt_checkpoint_fails_and_leaves_no_partial_file(tmp_path, capsys):
    from torch.distributed.checkpoint import FileSystemReader

    from angel_ptm import cli

    build, _, loss_fn = CASES["gpt"]
    engine = angel_ptm.initialize(build(), config(tmp_path, "a"))
    try:
        step(engine, loss_fn, batches("gpt", 1)[0])
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    # one bit flipped in the param item written last: the tensors before it export, then its checksum fails
    items = FileSystemReader(tmp_path / "ckpt").read_metadata().storage_data
    last = max((info for key, info in items.items() if key.fqn.startswith("param.")),
               key=lambda info: (info.relative_path, info.offset))
    path = tmp_path / "ckpt" / last.relative_path
    data = bytearray(path.read_bytes())
    data[last.offset + last.length // 2] ^= 1
    path.write_bytes(bytes(data))
    assert cli.main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out" / "model.safetensors")]) == 2
    assert capsys.readouterr().err.startswith("angel-ptm: error: ")
    assert list((tmp_path / "out").iterdir()) == []
