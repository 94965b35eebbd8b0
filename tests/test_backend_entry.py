"""``torch.compile(model, backend="moe_fx")`` on the families whose experts loop over the experts a batch hits.

A backend is handed graphs, never modules, and Dynamo breaks the graph inside such a loop before any backend
is called, so only a capture step before tracing (``moe_fx.compile``) rewrites DBRX, LongCat-Flash and
Step-3.7: the backend entry warns once per model, naming the layers and ``moe_fx.compile``, and explain says
per layer which entry rewrites it. JetMoE's block graph-breaks only at its ``.tolist()`` counts, which the
Dynamo options the backend sets when it is loaded allow: the backend entry rewrites it itself.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import moe_fx
from moe_fx.backend import UncapturedExpertsWarning, make_backend
from moe_fx.testing.families import tiny_family_model

pytest.importorskip("transformers")

HIT_LOOPS = {"dbrx": "DbrxExperts", "longcat_flash": "LongcatFlashExperts", "step3p7": "Step3p7Experts"}


def _compile_with_backend(model, ids):
    """The backend entry (the passes without Inductor: the graphs are checked, not compiled). One call compiles
    one graph per frame (the hit loops break the model into several): one warning for them all."""
    torch._dynamo.reset()
    sink = []
    compiled = torch.compile(model, backend=make_backend(sink=sink, inductor=False))
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        compiled(ids)
    return sink, [w for w in seen if issubclass(w.category, UncapturedExpertsWarning)]


@pytest.mark.parametrize("family", sorted(HIT_LOOPS))
def test_hit_loop_families_warn_once_and_explain_names_the_entry(family):
    model = tiny_family_model(family, num_layers=1)
    ids = torch.randint(1, 100, (1, 6))
    sink, warned = _compile_with_backend(model, ids)
    assert not any(r.matched for r in sink)  # the backend entry leaves them as written
    (w,) = warned
    text = str(w.message)
    assert HIT_LOOPS[family] in text and "moe_fx.compile(model)" in text and ".experts" in text
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = moe_fx.explain(model, ids)  # captures first, as moe_fx.compile does: nothing to warn about
    assert not [w for w in seen if issubclass(w.category, UncapturedExpertsWarning)]
    captured = [r for r in report.regions if r.form == "hit_loop"]
    assert captured and all(r.entry == "moe_fx.compile" for r in captured if r.matched)
    if family != "step3p7":  # Step-3.7's one layer clamps after the activation: a near miss for both entries
        assert all(r.matched for r in captured)
        assert "rewritten by moe_fx.compile only" in str(report) and captured[0].layer in str(report)
    assert all(layer_path in text for layer_path in (r.layer for r in captured))


def test_jetmoe_is_rewritten_by_the_backend_entry_itself():
    model = tiny_family_model("jetmoe", num_layers=1)
    ids = torch.randint(1, 100, (1, 6))
    sink, warned = _compile_with_backend(model, ids)
    assert warned == [] and sink and all(r.matched for r in sink)
    report = moe_fx.explain(model, ids)
    assert [r.entry for r in report.matched] == ["any"] and "moe_fx.compile only" not in str(report)
