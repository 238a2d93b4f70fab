"""engines/fingerprint.py: what a digest covers, worked on files made here."""

from __future__ import annotations


def test_a_model_digest_is_of_its_weights_or_none(tmp_path):
    """The report's model digest (engines/fingerprint.weights_digest): a directory's weight files and
    config by content, a single file by its own; a directory without weight files has none."""
    from engines.fingerprint import weights_digest

    (tmp_path / "config.json").write_text("{}")
    assert weights_digest(tmp_path) is None  # a config alone: its weights lie elsewhere
    (tmp_path / "model.safetensors").write_bytes(b"w1")
    first = weights_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("not weights")
    assert weights_digest(tmp_path) == first  # only what decides outputs
    (tmp_path / "model.safetensors").write_bytes(b"w2")
    assert weights_digest(tmp_path) not in (first, None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"g")
    import hashlib

    assert weights_digest(gguf) == hashlib.sha256(b"g").hexdigest()
