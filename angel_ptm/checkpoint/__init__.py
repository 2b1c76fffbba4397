"""Checkpoints: the whole training state in torch.distributed.checkpoint's format, streamed from the pages.

    engine.save_checkpoint("ckpts/step-5", extra={"step": 5})
    extra = engine.load_checkpoint("ckpts/step-5")
    Checkpoints("ckpts", keep=2).save(engine, 5, extra)     # step-5/, `latest`, the oldest beyond `keep` removed

boxes.py (flat runs of a tensor as DCP chunks), planners.py (what a rank writes and reads), storage.py (files with
checksums), save_load.py (the collective save and load), directory.py (a run's checkpoints).
"""

from angel_ptm.checkpoint.save_load import load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint"]
