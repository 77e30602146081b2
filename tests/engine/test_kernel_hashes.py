"""The generated kernels are byte-identical to those of the recorded corpus (kernel_corpus.py):
every variant's forward (static and dynamic shapes) and backward (fast and deterministic,
warp-specialised and the automatic pipeline, with custom gradients) at default and
tuner-space configs, the decode kernels, and the linear-attention kernels. A deliberate
change to a generator re-records the hashes with `python tests/engine/kernel_corpus.py
--write` and says why in its commit."""

from __future__ import annotations

import json

import kernel_corpus


def test_every_generated_source_matches_its_recorded_hash():
    want = json.loads(kernel_corpus.HASHES.read_text())
    diff = kernel_corpus.differences(want, kernel_corpus.corpus_hashes())
    assert not diff, f"{len(diff)} generated sources changed, e.g.:\n" + "\n".join(diff[:20])
