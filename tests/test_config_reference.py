"""The configuration reference (``launch/train.py --help-config``, ``docs/config.md``) against the typed
config it is read from: every key of every section is listed with a meaning, its default read back
through ``--set`` gives the default config, its range is what validation enforces, and the committed
docs/config.md and cosmoflow/config_reference.txt are the generator's current output."""

from __future__ import annotations

import dataclasses

from cosmoflow.config import Config, load_config
from cosmoflow.config_reference import _comments, markdown, sections, text
from cosmoflow.train_args import REFERENCE
from cosmoflow.trainer import main

from distributed import ROOT


def _declared() -> list[str]:
    """Every key of the typed config, dotted."""
    keys = []
    for f in dataclasses.fields(Config):
        sub = getattr(Config(), f.name)
        keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(sub)] if dataclasses.is_dataclass(sub) \
            else [f.name]
    return keys


def test_every_key_has_type_default_and_meaning():
    keys = {k.name: k for s in sections() for k in s.keys}
    assert sorted(keys) == sorted(_declared())
    assert not [k for k, v in keys.items() if not v.meaning.strip()], "keys without a meaning"
    assert all(s.meaning for s in sections())
    # the meaning is the comment beside the declaration, continuation lines included
    assert keys["train.batch_size"].meaning == "global batch"
    augment = keys["data.augment"].meaning
    assert augment.endswith("symmetries+shifts (and periodic rolls: whole universes only)"), augment
    assert keys["train.max_steps"].type == "int or null" and keys["model.dense"].type == "list[int]"
    assert keys["data.workers"].range == ">= 0 (0: read in the training process)"
    assert keys["train.seed"].range == ">= 0, < 2147483648" and keys["model.dropout"].range == ">= 0, < 1"
    assert keys["train.epochs"].range == ">= 1" and keys["data.train"].range == ""
    assert "Config.parallel" in _comments() and len(_comments()) >= len(keys)


def test_defaults_read_back_as_the_default_config():
    """Each key set to the default the reference shows (as --set reads it) gives the default config."""
    default = Config().to_dict()
    for s in sections():
        for k in s.keys:
            assert load_config(None, [f"{k.name}={k.default}"]).to_dict() == default, k.name


def test_help_config_prints_it_and_docs_are_current(capsys):
    """``--help-config`` prints the committed cosmoflow/config_reference.txt (read without torch), which
    is the generator's current text."""
    assert REFERENCE.read_text() == text(), ("cosmoflow/config_reference.txt is stale: python -m "
                                             "cosmoflow.config_reference > cosmoflow/config_reference.txt")
    assert main(["--help-config"]) == 0
    printed = capsys.readouterr().out
    assert printed == text() and all(f"  {k} " in printed for k in _declared())
    committed = (ROOT / "docs/config.md").read_text()
    assert committed == markdown(), ("docs/config.md is stale: python -m cosmoflow.config_reference "
                                     "--markdown > docs/config.md")
