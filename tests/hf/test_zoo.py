"""Every decoder-only causal-LM family transformers can build from a tiny config, float64: ndp is EXACT or REFUSES
by name (``ndp.hf.Unsupported``); never a silent difference, never an unrelated crash.

(a) 1 process: ndp attention against the model's eager attention (logits).
(c) 1 process: ndp's fused LM-head loss (``ndp.hf.head.head_loss``, what ``ndp-train`` uses) against cross_entropy
on the model's own logits (the loss and every gradient).
(b) cp 2, ring and Ulysses, zigzag: ``ndp.hf.parallelize`` + ``shard_batch`` + ``ndp.hf.loss`` on 2 gloo ranks
against one process on the whole batch (the loss and every gradient).
(e) 1 process: documents packed in one row (position_ids restarting, ``cu_seq_lens_q``) against each document in
a call of its own (the loss and every gradient); a model whose layers would let the documents see each other is
refused by name (``ndp.hf.check_packed_model``).
(f) cp 2, ring, Ulysses and all-gather: (e)'s packed row sharded per document by ``shard_batch`` (the shards'
document table) against each document in a call of its own on one process; a model whose layers do not hand the
table to the attention gets it through ndp's mask marker, or is refused.
(j) cp 2, ring: a right-padded batch as a tokenizer and a padding collator give it (attention_mask 0 at the pads,
no position_ids, labels -100 there) through ``shard_batch`` against one process's run of the padded batch with its
mask (the loss and every gradient); with ndp.hf.loss on the logits, and with the model's own loss (``model(**batch,
labels=...).loss``, what a user's loop and transformers' Trainer read).
(k) cp 2, ring: (b) with transformers' activation checkpointing on (``gradient_checkpointing_enable``, as Trainer's
``gradient_checkpointing=True``), non-reentrant (its default) and reentrant, every family whose layers it checkpoints.
(l) 1 process: a batch with a right-padded and a left-padded row (attention_mask, no position_ids) through ndp's
attention against the model's sdpa (eager where it has none), the loss and every gradient.
(m) cp 2, ring: (b) with the model in float32 under bf16 autocast (a loop under ``torch.autocast``) against the
float64 truth: at most ``_zoo.BF16_RATIO`` times as far from it as one process's run of the model's sdpa under the
same autocast (a family that routes tokens to experts: every gradient there).
(g) cp 2, ring: (b) with the routers' load-balancing loss on, for every MoE family whose causal LM adds one
(``ndp.hf.router``: each rank's share of the batch's), ``ndp.hf.loss + coef x aux_loss`` against one process's
loss with its own load-balancing loss; a family whose loss ndp does not reproduce is refused by name; and on (j)'s
right-padded batch, whose pads the family's loss leaves out by its mask.
(d) tp 2 with the model's own plan (``base_model_tp_plan``): the same comparison; a plan ndp cannot apply exactly is
refused by name (``ndp.hf.check_tp_plan``).
(h) cp 2 x tp 2 on 4 ranks, ring: (b) with the model also split by its own plan (no family exact under each alone may
be off under both).
(i) cp 2, ring: every image-text-to-text family (the class a vision-language model is fine-tuned as) on a text-only
batch as a tokenizer gives it (no position_ids), against one process (the loss and every gradient).

Every check takes float64 softmaxes in float64 (``_zoo.float64_softmax``: eager attention's are float32).

``python tests/hf/test_zoo.py`` prints the table (the counts in the README come from it)."""
import collections
import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist import spawn  # noqa: E402
import _zoo  # noqa: E402

# Families whose CP run breaks in FSDP2 itself on gloo (a collective mismatch between the ranks' backward
# reduce-scatters), not in ndp's attention: listed, not hidden; (a) still runs for them.
CP_KNOWN = {}
MIN_EXACT_SINGLE = 140
MIN_EXACT_CP = 124
MIN_EXACT_FUSED = 154
MIN_EXACT_TP = 109
MIN_EXACT_PACKED = 104
MIN_EXACT_CP_PACKED = 104
MIN_EXACT_CP_AUX = 24
MIN_EXACT_CP_TP = 107
MIN_EXACT_VLM_TEXT = 57
MIN_EXACT_CP_PADDED = 124
MIN_EXACT_PADDED = 139
MIN_EXACT_CP_CHECKPOINTED = {False: 122, True: 121}  # reentrant: gemma3n_text refused (KV sharing)
MIN_EXACT_CP_AUTOCAST = 126


def _quiet():
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()


def _parallel_body(rank, world, fams, impl, out):
    import torch.distributed as dist

    _quiet()
    for mt in fams:
        if impl == "tp":
            r = _zoo.tp(mt, world)
        elif impl.startswith("cp_tp:"):
            r = _zoo.cp(mt, impl.split(":")[1], 2, tp_size=world // 2)
        elif impl.startswith("checkpointed"):  # checkpointed:X, checkpointed_reentrant:X
            reentrant = impl.startswith("checkpointed_reentrant:")
            r = _zoo.cp(mt, impl.split(":")[1], world, checkpointing={"use_reentrant": reentrant})
        elif impl.startswith("packed:"):
            r = _zoo.cp_packed(mt, impl.split(":")[1], world)
        elif impl.startswith("aux:") or impl.startswith("aux_padded:"):
            r = _zoo.cp_aux(mt, impl.split(":")[1], world, padded=impl.startswith("aux_padded:"))
        elif impl.startswith("padded"):  # padded:X, padded_own:X
            r = _zoo.cp_padded(mt, impl.split(":")[1], world, own_loss=impl.startswith("padded_own:"))
        elif impl.startswith("autocast:"):
            r = _zoo.cp_autocast(mt, impl.split(":")[1], world)
        elif impl.startswith("vlm:"):
            r = _zoo.cp_vlm_text(mt, impl.split(":")[1], world)
        else:
            r = _zoo.cp(mt, impl, world)
        rs = [None] * world
        dist.all_gather_object(rs, r)
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps([mt, rs]) + "\n")


def run_single():
    _quiet()
    return {mt: _zoo.single(mt) for mt in _zoo.families()}


def run_parallel(fams, tmp, impl="ring", world=2):
    out = os.path.join(tmp, f"zoo_{impl.replace(':', '_')}.jsonl")
    open(out, "w").close()
    spawn(_parallel_body, world, tmp, fams, impl, out, timeout_s=60)
    res = {}
    for line in open(out):
        mt, rs = json.loads(line)
        res[mt] = tuple(rs[0]) if all(r == rs[0] for r in rs) else ("DISAGREE", str(rs))
    return res


def _bad(results):
    return {mt: r for mt, r in results.items() if r[0] not in ("EXACT", "REFUSED", "UNBUILT")}


def _exact_or_refused(results, min_exact):
    assert not _bad(results), _bad(results)
    exact = sum(r[0] == "EXACT" for r in results.values())
    assert exact >= min_exact, collections.Counter(r[0] for r in results.values())


def cp_families(single):
    """The families (a) built, CP not known broken: what the multi-process rows run."""
    return [mt for mt, r in single.items() if r[0] != "UNBUILT" and mt not in CP_KNOWN]


@pytest.fixture(scope="module")
def single_results():
    return run_single()


def test_zoo_single_process_exact_or_refused(single_results):
    _exact_or_refused(single_results, MIN_EXACT_SINGLE)


def run_fused():
    _quiet()
    return {mt: _zoo.fused(mt) for mt in _zoo.families()}


def test_zoo_fused_loss_exact_or_refused():
    _exact_or_refused(run_fused(), MIN_EXACT_FUSED)


def run_padded_single(single):
    _quiet()
    return {mt: _zoo.padded_single(mt) for mt, r in single.items() if r[0] != "UNBUILT"}


def test_zoo_padded_rows_exact_or_refused(single_results):
    _exact_or_refused(run_padded_single(single_results), MIN_EXACT_PADDED)


def run_packed():
    _quiet()
    return {mt: _zoo.packed(mt) for mt in _zoo.families()}


def test_zoo_packed_documents_exact_or_refused():
    _exact_or_refused(run_packed(), MIN_EXACT_PACKED)


@pytest.mark.distributed
@pytest.mark.timeout(900)  # 94-102 s measured on the 2-core machines; hangs fail in 60 s (spawn)
@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_zoo_cp2_exact_or_refused(single_results, tmp_path, impl):
    fams = cp_families(single_results)
    results = run_parallel(fams, str(tmp_path), impl)
    assert set(results) == set(fams)
    _exact_or_refused(results, MIN_EXACT_CP)


@pytest.mark.distributed
@pytest.mark.timeout(900)  # 83-89 s measured
@pytest.mark.parametrize("impl", ["ring", "ulysses", "allgather"])
def test_zoo_cp2_packed_documents_exact_or_refused(single_results, tmp_path, impl):
    fams = cp_families(single_results)
    results = run_parallel(fams, str(tmp_path), f"packed:{impl}")
    assert set(results) == set(fams)
    _exact_or_refused(results, MIN_EXACT_CP_PACKED)


@pytest.mark.distributed
@pytest.mark.timeout(900)  # 119-139 s measured
@pytest.mark.parametrize("reentrant", [False, True])
def test_zoo_cp2_activation_checkpointing_exact_or_refused(single_results, tmp_path, reentrant):
    fams = checkpointed_families(single_results)
    results = run_parallel(fams, str(tmp_path), f"checkpointed{'_reentrant' if reentrant else ''}:ring")
    assert set(results) == set(fams)
    _exact_or_refused(results, MIN_EXACT_CP_CHECKPOINTED[reentrant])


def checkpointed_families(single):
    """The built families (CP not known broken) whose layers transformers can checkpoint."""
    return [mt for mt in cp_families(single) if _zoo.checkpointable(mt)]


def aux_families(single):
    """The built families (CP not known broken) whose causal LM adds a load-balancing loss."""
    return [mt for mt in cp_families(single) if _zoo.has_aux_loss(mt)]


@pytest.mark.distributed
@pytest.mark.timeout(900)  # 75-90 s measured
@pytest.mark.parametrize("loss", ["padded", "padded_own"])  # ndp.hf.loss on the logits; the model's own (labels given)
def test_zoo_cp2_padded_batch_exact_or_refused(single_results, tmp_path, loss):
    fams = cp_families(single_results)
    results = run_parallel(fams, str(tmp_path), f"{loss}:ring")
    assert set(results) == set(fams)
    _exact_or_refused(results, MIN_EXACT_CP_PADDED)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_zoo_cp2_bf16_autocast_exact_or_refused(single_results, tmp_path):
    fams = cp_families(single_results)
    results = run_parallel(fams, str(tmp_path), "autocast:ring")
    assert set(results) == set(fams)
    _exact_or_refused(results, MIN_EXACT_CP_AUTOCAST)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("batch", ["aux", "aux_padded"])  # dense rows; (j)'s right-padded batch (16 s measured)
def test_zoo_cp2_load_balancing_loss_exact_or_refused(single_results, tmp_path, batch):
    fams = aux_families(single_results)
    results = run_parallel(fams, str(tmp_path), f"{batch}:ring")
    assert set(results) == set(fams)
    _exact_or_refused(results, MIN_EXACT_CP_AUX)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_zoo_tp2_exact_or_refused(single_results, tmp_path):
    fams = [mt for mt, r in single_results.items() if r[0] != "UNBUILT"]
    results = run_parallel(fams, str(tmp_path), "tp")
    assert set(results) == set(fams)
    _exact_or_refused(results, MIN_EXACT_TP)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_zoo_cp2_tp2_exact_or_refused(single_results, tmp_path):
    fams = cp_families(single_results)
    results = run_parallel(fams, str(tmp_path), "cp_tp:ring", world=4)
    assert set(results) == set(fams)
    _exact_or_refused(results, MIN_EXACT_CP_TP)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_zoo_vision_language_text_only_cp2_exact_or_refused(tmp_path):
    fams = _zoo.vlm_families()
    results = run_parallel(fams, str(tmp_path), "vlm:ring")
    assert set(results) == set(fams)
    _exact_or_refused(results, MIN_EXACT_VLM_TEXT)


if __name__ == "__main__":
    import tempfile

    t0 = time.time()
    single = run_single()
    fams = cp_families(single)
    fused, packed, padded = run_fused(), run_packed(), run_padded_single(single)
    impls = ("ring", "ulysses", "packed:ring", "packed:ulysses", "packed:allgather", "padded:ring", "padded_own:ring",
             "checkpointed:ring", "checkpointed_reentrant:ring", "autocast:ring", "aux:ring", "aux_padded:ring", "tp",
             "cp_tp:ring")
    which = {"aux": aux_families(single), "checkpointed": checkpointed_families(single)}
    runs = {impl: run_parallel(which.get(impl.split(":")[0].split("_")[0], fams), tempfile.mkdtemp(), impl,
                               world=4 if impl.startswith("cp_tp:") else 2)
            for impl in impls}
    names = ["1 process", "fused loss", "packed", "padded rows"] + [f"cp {i.replace(':', ' ')}" for i in impls]
    print(f"{'family':28s} " + " ".join(f"{n:{max(10, len(n))}s}" for n in names) + " detail")
    for mt, r in single.items():
        cols = [r, fused[mt], packed[mt], padded.get(mt, ("-", ""))]
        cols += [runs[i].get(mt, ("-", CP_KNOWN.get(mt, ""))) for i in impls]
        detail = r[1] if r[0] != "EXACT" else next((x[1] for x in cols if x[0] not in ("EXACT", "-")), "")
        print(f"{mt:28s} " + " ".join(f"{x[0]:{max(10, len(n))}s}" for x, n in zip(cols, names)) + " "
              f"{detail if isinstance(detail, str) else f'{detail:.1e}'}")
    print("1 process:", dict(collections.Counter(r[0] for r in single.values())))
    print("fused loss:", dict(collections.Counter(r[0] for r in fused.values())))
    print("packed:", dict(collections.Counter(r[0] for r in packed.values())))
    print("padded rows:", dict(collections.Counter(r[0] for r in padded.values())))
    for impl, res in runs.items():
        name = {"tp": "tp 2", "cp_tp:ring": "cp 2 x tp 2 ring"}.get(impl, f"cp 2 {impl.replace(':', ' ')}")
        print(f"{name}:", dict(collections.Counter(r[0] for r in res.values())))
    vlm = run_parallel(_zoo.vlm_families(), tempfile.mkdtemp(), "vlm:ring")
    for mt, r in vlm.items():
        print(f"{mt:28s} {r[0]:10s} {r[1] if isinstance(r[1], str) else f'{r[1]:.1e}'}")
    print("image-text-to-text, text-only, cp 2 ring:", dict(collections.Counter(r[0] for r in vlm.values())))
    print(f"took {time.time() - t0:.0f} s")
