"""The tokenizer served by a worker process (the search's child process never imports transformers / torch):
the same ids as the tokenizer itself, its special-token ids, a worker that ends on release and comes back on
the next call, and a clear error for a folder without a usable tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from quantkit.errors import ModelError  # noqa: E402
from quantkit.frontends.hf_folder import load_hf_tokenizer  # noqa: E402
from quantkit.frontends.tokenizer_worker import WorkerTokenizer, isolate, isolated  # noqa: E402


def _folder() -> Path:
    from quantkit.frontends.builtin import _minilm_folder

    return Path(_minilm_folder())


def test_worker_tokenizer_gives_the_tokenizers_own_ids() -> None:
    folder = _folder()
    direct = load_hf_tokenizer(folder)
    text = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition."
    texts = ["A short one.", "Another sentence, a little longer than the first one was."]
    tok = WorkerTokenizer(str(folder))
    try:
        assert tok._torch is False  # served by a worker with torch hidden (~170 MB instead of ~370 MB)
        assert tok(text, add_special_tokens=False)["input_ids"] == direct(text, add_special_tokens=False)["input_ids"]
        got = tok(texts, add_special_tokens=True, truncation=True, max_length=8)
        want = direct(texts, add_special_tokens=True, truncation=True, max_length=8)
        assert got["input_ids"] == want["input_ids"] and got["attention_mask"] == want["attention_mask"]
        assert len(tok) == len(direct)
        assert (tok.pad_token_id, tok.eos_token_id) == (direct.pad_token_id, direct.eos_token_id)
        with pytest.raises(AttributeError):
            tok.no_such_attribute  # noqa: B018
        proc = tok._proc
        tok.release()
        assert not proc.is_alive()
        # a call after release starts a new worker: still correct
        assert tok(text, add_special_tokens=False)["input_ids"] == direct(text, add_special_tokens=False)["input_ids"]
    finally:
        tok.release()


def test_isolated_processes_load_worker_tokenizers_and_bad_folders_fail_clearly(tmp_path: Path) -> None:
    assert not isolated()
    isolate()
    try:
        tok = load_hf_tokenizer(_folder())
        assert isinstance(tok, WorkerTokenizer)
        tok.release()
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "config.json").write_text("{}")
        (bad / "tokenizer.json").write_text("not json")
        with pytest.raises(ModelError, match="cannot load a tokenizer"):
            load_hf_tokenizer(bad)
    finally:
        isolate(False)
