"""bench/gpu_recipes.sh on CPU: every recipe it documents has a branch, and every benchmark command it holds parses
with the benchmark's own arguments (a renamed flag, variant or setting would otherwise show only on the GPU
machine, after a machine start)."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

from helpers import load_bench

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_recipes.sh"


def _variables(text: str) -> dict[str, list[str]]:
    """The script's ``NAME="..."`` command variables, as argument lists (``$OUT`` made a plain path)."""
    found = re.findall(r'^([A-Z0-9_]+)="(bench/[^"]+)"', text, flags=re.MULTILINE | re.DOTALL)
    return {name: shlex.split(value.replace("$OUT", "/tmp/out")) for name, value in found}


def test_every_documented_recipe_has_a_branch_and_back():
    text = SCRIPT.read_text()
    # a line may document several recipes ("a, b  what they do"), a branch serve several ("a|b)")
    documented = {name for group in re.findall(r"^#   ((?:[a-z0-9_]+, )*[a-z0-9_]+) ", text, flags=re.MULTILINE)
                  for name in group.split(", ")}
    branches = {name for group in re.findall(r"^    ([a-z0-9_|]+)\)$", text, flags=re.MULTILINE)
                for name in group.split("|")}
    assert documented and documented == branches
    assert {"fwd_flat", "fwd_flat_1", "fwd_flat_2", "tune_bf16_prefill", "gen_ab_cpp"} <= branches


def test_every_benchmark_command_parses():
    text = SCRIPT.read_text()
    commands = _variables(text)
    assert set(commands) == {"E2E_GEN", "E2E_AB", "E2E_FULL", "E2E_COMPILE", "E2E_FP8", "E2E_FLAT", "LAYER",
                             "PASS_TIME", "TUNE_FP8", "TUNE_BF16", "L2", "CG", "CG_QWEN3", "SLOT_DOWN", "W8A16",
                             "BREAKDOWN", "EPILOGUE", "DG_HINT", "SCALE_SCRATCH"}
    e2e, cudagraphs = load_bench("e2e_model"), load_bench("generate_cudagraphs")
    for name in ("E2E_GEN", "E2E_AB", "E2E_COMPILE", "L2"):
        args = e2e.parse_args(commands[name][1:])
        assert args.models == "gpt_oss" and args.no_deepgemm
    # qwen3_gen32 runs E2E_GEN with the model and depth swapped by bash's ${E2E_GEN/pattern/replacement}
    (pattern, replacement), = re.findall(r"\$\{E2E_GEN/([^/}]+)/([^}]+)\}", text)
    swapped = " ".join(commands["E2E_GEN"][1:])
    assert pattern in swapped
    qwen3_gen = e2e.parse_args(swapped.replace(pattern, replacement).split())
    assert qwen3_gen.models == "qwen3" and qwen3_gen.layers == "32" and qwen3_gen.share_weights and qwen3_gen.no_forward
    full = e2e.parse_args(commands["E2E_FULL"][1:])
    assert full.models == "mixtral" and full.layers == "full" and full.no_deepgemm  # the one model that needs an H200
    fp8 = e2e.parse_args(commands["E2E_FP8"][1:])
    assert fp8.weights == "fp8_checkpoint" and set(fp8.models.split(",")) <= set(e2e.MODELS) - {"gpt_oss"}
    flat = e2e.parse_args(commands["E2E_FLAT"][1:])
    assert set(flat.models.split(",")) == set(e2e.MODELS) and flat.no_deepgemm and flat.share_weights
    # fwd_flat_1 and fwd_flat_2 split the same models between two calls
    (first, second), = re.findall(r"fwd_flat_1 \] && echo (\S+) \|\| echo (\S+)\)", text)
    assert sorted(first.split(",") + second.split(",")) == sorted(e2e.MODELS)
    layer = load_bench("moe_layer").parse_args(commands["LAYER"][1:])
    assert set(layer.shapes.split(",")) <= set(load_bench("moe_layer").SHAPES) and layer.out == "/tmp/out"
    assert {"moe_fx_bf16", "moe_fx_fp8", "hf_grouped_mm"} == set(layer.impls.split(","))
    slot_down = load_bench("fused_activation").parse_args(commands["SLOT_DOWN"][1:])
    assert slot_down.switch == "slot_down" and slot_down.tokens == "1" and slot_down.out == "/tmp/out"
    w8a16 = load_bench("fused_activation").parse_args(commands["W8A16"][1:])
    # decode sizes, up to 64 rows per expert (Mixtral T=256) with W8A16 on up to 64
    assert w8a16.switch == "w8a16" and w8a16.on == "64" and max(int(t) for t in w8a16.tokens.split(",")) <= 256
    # dg_switches: the DeepGEMM switches, each over the sizes where its layout runs under auto (and controls)
    for name, switch in (("DG_HINT", "dg_hint"), ("SCALE_SCRATCH", "scale_scratch")):
        dg_switch = load_bench("fused_activation").parse_args(commands[name][1:])
        assert dg_switch.switch == switch and set(dg_switch.shapes.split(",")) == {"dsv3", "mixtral", "qwen3"}
    assert "4096" in load_bench("fused_activation").parse_args(commands["DG_HINT"][1:]).tokens.split(",")
    epilogue = load_bench("fused_activation").parse_args(commands["EPILOGUE"][1:])
    assert epilogue.switch == "epilogue" and epilogue.set == ["masked_experts.pipeline.FUSE_HALVES_MAX_ROWS=None"]
    breakdown = load_bench("kernel_breakdown")
    bd = breakdown.parse_args(commands["BREAKDOWN"][1:] + ["--fp8"])
    assert set(bd.shapes.split(",")) <= set(breakdown.SHAPES) and bd.fp8 and bd.out == "/tmp/out"
    assert all(int(t) >= 1024 for t in bd.tokens.split(","))  # prefill sizes only
    # dg_breakdown_fp8: $BREAKDOWN with its own shapes and tokens, the op's choice under auto
    (extra,) = re.findall(r"\$BREAKDOWN (--shapes .*--kernel-choice auto) \\", text)
    dg = breakdown.parse_args(commands["BREAKDOWN"][1:] + extra.split())
    assert dg.kernel_choice == "auto" and dg.fp8 and set(dg.shapes.split(",")) == {"dsv3", "mixtral", "qwen3"}
    assert all(int(t) >= 1024 for t in dg.tokens.split(","))
    # breakdown_plain: decode sizes, each row also profiled as plain calls
    for extra in re.findall(r"\$BREAKDOWN (--shapes \S+ --tokens \S+ --plain[^>\\]*)", text):
        plain = breakdown.parse_args(commands["BREAKDOWN"][1:] + extra.split())
        assert plain.plain and max(int(t) for t in plain.tokens.split(",")) <= 16
    pass_time = load_bench("pass_time").parse_args(commands["PASS_TIME"][1:])
    assert pass_time.real and set(pass_time.real.split(",")) <= set(e2e.MODELS) and str(pass_time.out) == "/tmp/out"
    tune = load_bench("tune_tiles").parse_args(commands["TUNE_FP8"][1:])
    assert tune.sorted and tune.kinds == "fp8" and tune.ship and tune.out == "/tmp/out"
    # each run retunes the regimes above 16 rows per expert only (the ones the new candidate joined)
    from moe_fx.lowering.problem import row_regime, rows_per_expert

    layer_shapes = load_bench("moe_layer").SHAPES
    runs = re.findall(r"\$TUNE_FP8 --shapes (\S+) --tokens (\S+)", text)
    assert runs
    for shapes, tokens in runs:
        for shape in shapes.split(","):
            _, e, k, _, _ = layer_shapes[shape]
            assert all(row_regime(rows_per_expert(int(t), k, e)) >= 2 for t in tokens.split(",")), (shape, tokens)
    # tune_decode_*: every cell's token counts fall in the decode regimes (at most 16 rows per expert), every bench
    # shape has a cell
    (cells,) = re.findall(r"for cell in ((?:\S+:\S+ ?)+); do", text)
    decode_shapes = set()
    for cell in cells.split():
        shapes, tokens = cell.split(":")
        for shape in shapes.split(","):
            decode_shapes.add(shape)
            _, e, k, _, _ = layer_shapes[shape]
            assert all(row_regime(rows_per_expert(int(t), k, e)) <= 1 for t in tokens.split(",")), (shape, tokens)
    assert decode_shapes == set(layer_shapes) - {"olmoe"}
    bf16 = load_bench("tune_tiles").parse_args(commands["TUNE_BF16"][1:] + ["--budget-s", "1"])
    assert bf16.sorted and bf16.kinds == "bf16" and bf16.ship and bf16.force and bf16.out == "/tmp/out"
    # the bf16 retune covers the two prefill regimes (above 64 rows per expert) of every bench shape, nothing below
    bf16_runs = re.findall(r"\$TUNE_BF16 --budget-s \d+ --shapes (\S+) --tokens (\S+)", text)
    assert {s for shapes, _ in bf16_runs for s in shapes.split(",")} == set(layer_shapes)
    for shapes, tokens in bf16_runs:
        for shape in shapes.split(","):
            _, e, k, _, _ = layer_shapes[shape]
            regimes = {row_regime(rows_per_expert(int(t), k, e)) for t in tokens.split(",")}
            assert regimes == {3, 4}, (shape, tokens, regimes)
    cg = cudagraphs.parse_args(commands["CG"][1:])
    assert cg.model == "gpt_oss" and cg.layers == 24
    cg_qwen3 = cudagraphs.parse_args(commands["CG_QWEN3"][1:])
    assert cg_qwen3.model == "qwen3" and cg_qwen3.layers == 48 and cg_qwen3.out == "/tmp/out"
    used = re.findall(r"--variants ([\w,-]+)", text)
    assert used and all(v in cudagraphs.BY_NAME for group in used for v in group.split(","))
    # the settings the recipes flip exist under the names they give
    moe_layer = load_bench("moe_layer")
    for pair in re.findall(r"--(?:ab-)?set (\S+)", text):
        name, _, _ = pair.partition("=")
        path, attr = name.rsplit(".", 1)
        assert hasattr(importlib.import_module(moe_layer.qualified_setting(path)), attr), name


def test_pack_archives_each_recipe_as_it_ends(tmp_path):
    """PACK=1: one archive per recipe, holding what that recipe wrote, so a call cut off later keeps it. The two
    recipes' benchmarks fail at once on a machine without a GPU; their logs are what they write."""
    import subprocess
    import sys
    import tarfile

    out = tmp_path / "out"
    # the recipes' python3 is the test's own interpreter (torch importable) and sees no GPU, on a GPU machine too, so
    # the benchmarks stop at their CUDA work within seconds
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OUT": str(out), "PACK": "1", "HOME": str(tmp_path),
           "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(SCRIPT), "breakdown_decode", "fwd_flat_1"], cwd=SCRIPT.parent.parent,
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["results_breakdown_decode.tgz", "results_fwd_flat_1.tgz"]

    def names(recipe: str) -> set[str]:
        with tarfile.open(out / f"results_{recipe}.tgz") as tar:
            return {Path(m.name).name for m in tar.getmembers() if m.isfile()}

    first, second = names("breakdown_decode"), names("fwd_flat_1")
    assert {"log_breakdown_decode.txt", "gpu.txt"} <= first and "log_fwd_flat_1.txt" not in first
    assert second == {"log_fwd_flat_1.txt"}


def test_peer_recipes_parse():
    """The vLLM-peer recipes' bench/peer_layer.py options: each call's shapes exist, and peer_issue's cells are issue
    16's table (every shape it names, its token counts), and a recipe of chosen cells takes them from that table."""
    text = SCRIPT.read_text()
    peer_layer, layer_shapes = load_bench("peer_layer"), load_bench("moe_layer").SHAPES
    calls = re.findall(r'^      peer_run "\$name" (.+?) ;;$', text, flags=re.MULTILINE)
    assert len(calls) == 5, calls
    (cells,) = re.findall(r'^PEER_ISSUE_CELLS="([^"]+)"$', text, flags=re.MULTILINE)
    issue_cells = peer_layer.parse_cells(cells, layer_shapes)
    assert issue_cells == {
        "qwen3": [1, 256, 1024, 4096], "mixtral": [64, 256, 4096], "dsv3": [64, 4096], "gpt_oss": [1, 256]}
    for call in calls:
        args = shlex.split(call.replace('"$PEER_ISSUE_CELLS"', "cells"))
        peer_layer.parse_args(["--peer", "p.py", *args])  # every option exists (argparse exits on one that does not)
        if "--shapes" in args:
            assert set(args[args.index("--shapes") + 1].split(",")) <= set(layer_shapes), call
        elif args[:2] == ["--cells", "cells"]:
            assert args == ["--cells", "cells"], call
        else:  # a recipe of a few of the issue's cells (peer_mixtral256)
            chosen = peer_layer.parse_cells(args[args.index("--cells") + 1], layer_shapes)
            assert all(set(ts) <= set(issue_cells[shape]) for shape, ts in chosen.items()), call
