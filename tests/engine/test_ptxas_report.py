"""engine/runtime/ptxas.py's reading of the SASS, and scripts/ptxas_survey.py's kernel choice
(CPU; neither needs nvcc here)."""

from __future__ import annotations

from engine.runtime.ptxas import pv_wait_placement
from tests.script_module import load_script

SASS = """
        /*2e90*/                   HGMMA.64x128x16.F32.BF16 R24, R180, gdesc[UR12].tnspB, R24, gsb0 ;
        /*2ea0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*2eb0*/                   FMNMX.FTZ R23, R88, -INF , !PT ;
        /*3280*/                   MUFU.EX2 R88, R88 ;
        /*3290*/                   MUFU.EX2 R92, R92 ;
        /*32a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*32b0*/                   MUFU.EX2 R96, R96 ;
        /*4ea0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*4eb0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*4ec0*/                   MUFU.EX2 R90, R90 ;
        /*5000*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def test_exponentials_are_counted_up_to_each_pv_wait():
    # two exponentials before the first step's P V wait, none before the second's; the
    # exponentials after a wait and a wait without a scores wait before it do not count
    assert pv_wait_placement(SASS) == [2, 0]
    assert pv_wait_placement("") == []


def _survey_module():
    return load_script("ptxas_survey")


def test_survey_picks_corpus_kernels_by_key_and_role():
    survey = _survey_module()
    key = "softmax|gqa-1000|bf16|fwd|default|static"
    picked = dict(survey.matching_sources([f"{key}|main"]))
    assert list(picked) == [f"{key}|main"]
    assert "T.prim_func" in picked[f"{key}|main"]
    assert not dict(survey.matching_sources([f"{key}|nosuchrole"]))
