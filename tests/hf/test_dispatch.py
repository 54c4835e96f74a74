"""How batches reach the ranks under CP and TP: each data-parallel rank's batch, the same on its CP and TP ranks;
dispatched (Accelerate's ``dispatch_batches``: process 0 reads and deals; its default for an iterable dataset) or
read by each process (rows that differ between the TP ranks of a batch refused)."""
import os

import pytest
import torch
import torch.nn.functional as F
from accelerate.parallelism_config import ParallelismConfig as AccelerateConfig
from accelerate.utils import DataLoaderConfiguration
from transformers import AutoModelForCausalLM

import ndp.accelerate
from dist import spawn
from test_accelerate import (_InOrder, _fsdp2_plugin, _one_process, _rank_env, _samples, _save_tiny_llama,
                             _trainer_args)


class _Stream(torch.utils.data.IterableDataset):
    """The tests' samples as a stream, in order."""

    def __iter__(self):
        return iter(_samples())


def _dispatch_rank(rank, world, tmp, model_dir, par, stream, evaluated, overrides):
    _rank_env(rank, world)
    args = _trainer_args(tmp, par, **{"per_device_eval_batch_size": 1, **overrides})
    trainer = _InOrder(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                       train_dataset=_Stream() if stream else _samples(), eval_dataset=_samples()[:evaluated or 1])
    trainer.train()
    ev = trainer.evaluate()["eval_loss"] if evaluated else None
    if rank == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        torch.save({"losses": losses, "eval": ev}, os.path.join(tmp, "dispatch.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("par, stream, evaluated, overrides", [
    pytest.param({"dp_shard_size": 2, "cp_size": 2}, True, 5, {}, id="cp2-stream"),
    pytest.param({"dp_shard_size": 2, "tp_size": 2}, True, 5, {}, id="tp2-stream"),
    # not dispatched: each process reads the stream and keeps its data-parallel rank's batches (Accelerate's own)
    pytest.param({"dp_shard_size": 2, "cp_size": 2}, True, 5, {"accelerator_config": {"dispatch_batches": False}},
                 id="cp2-stream-read"),
    # split_batches, its evaluation dispatched too: not checked (at dp_shard 2 alone, Accelerate's own dispatcher
    # included, the Trainer's evaluation loss of 4 rows is not their mean: 5.547224 against 5.550258)
    pytest.param({"dp_shard_size": 2, "cp_size": 2}, False, 0,
                 {"accelerator_config": {"dispatch_batches": True, "split_batches": True},
                  "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2}, id="cp2-split")])
def test_trainer_deals_dispatched_batches_by_data_parallel_rank(tmp_path, par, stream, evaluated, overrides):
    """Accelerate dealt a dispatched batch's pieces one per process: under CP each rank of one batch got other rows
    (refused at the first step, an iterable dataset never trained under CP); at dp_shard 2 x tp 2 both data-parallel
    ranks trained on process 0's piece, silently (losses 5.5714 / 5.5795 / 5.5266 against 5.5755 / 5.5489 /
    5.5477). Now each data-parallel rank gets its own, as one process taking both."""
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    spawn(_dispatch_rank, 4, tmp_path, str(tmp_path), model_dir, par, stream, evaluated, overrides, timeout_s=300)
    got = torch.load(tmp_path / "dispatch.pt")
    data = torch.stack([s["input_ids"] for s in _samples()])
    losses, model = _one_process(model_dir, data, steps=3, dp=2, clip=1.0)
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(losses, abs=1e-4)  # logged to 4 digits
    if not evaluated:
        return
    with torch.no_grad():
        logits = model(input_ids=data[:evaluated]).logits
        want = F.cross_entropy(logits[:, :-1].flatten(0, 1), data[:evaluated, 1:].flatten()).item()
    assert got["eval"] == pytest.approx(want, rel=1e-5)


def _resume_rank(rank, world, tmp, model_dir, par):
    _rank_env(rank, world)
    losses = {}
    # 3 of the stream's 5 steps without a stop; then saved after 2 and resumed there (in the middle of the epoch)
    for run, steps, resume in (("whole", 3, None), ("stopped", 2, None), ("stopped", 3, True)):
        args = _trainer_args(os.path.join(tmp, run), par, max_steps=steps, save_strategy="steps", save_steps=2)
        trainer = _InOrder(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=_Stream())
        trainer.train(resume_from_checkpoint=resume)
        losses[run] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if rank == 0:
        torch.save(losses, os.path.join(tmp, "resume.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("par", [{"dp_shard_size": 2, "cp_size": 2}, {"dp_shard_size": 2, "tp_size": 2}],
                         ids=["cp2", "tp2"])
def test_a_mid_epoch_resume_of_dispatched_batches_under_cp_or_tp_trains_as_without_a_stop(tmp_path, par):
    """The Trainer's resume in the middle of an epoch skips the trained batches with Accelerate's skip_first_batches,
    which rebuilt a dispatching loader as Accelerate's, dealing one piece per process (refused by name before: the
    ranks of a data-parallel batch would get different rows). The Accelerator's skip keeps dealing by data-parallel
    rank: the resumed run's third loss is the third loss of the run without a stop."""
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    spawn(_resume_rank, 4, tmp_path, str(tmp_path), model_dir, par, timeout_s=300)
    losses = torch.load(tmp_path / "resume.pt")
    assert len(losses["whole"]) == 3 and losses["stopped"] == pytest.approx(losses["whole"], rel=1e-6)


class _Numbered(torch.utils.data.IterableDataset):
    """Rows [i, i, i, i] for i = 0 .. 9: which batch a rank got shows in its values."""

    def __iter__(self):
        return (torch.full((4,), i) for i in range(10))


def _dealt_rank(rank, world, tp):
    _rank_env(rank, world)
    plugin = _fsdp2_plugin()
    par = AccelerateConfig(dp_shard_size=2, **({"tp_size": 2} if tp else {"cp_size": 2}))
    acc = ndp.accelerate.Accelerator(parallelism_config=par, fsdp_plugin=plugin)
    loader = acc.prepare(torch.utils.data.DataLoader(_Numbered(), batch_size=1))
    dp = rank // 2  # the mesh's data-parallel rank: ranks 0, 1 hold batch 2 s, ranks 2, 3 batch 2 s + 1
    assert [int(b[0, 0]) for b in loader] == [2 * s + dp for s in range(5)]
    assert acc.prepare(loader) is loader  # prepared again (a Trainer's evaluation loader): left as it is
    assert [int(b[0, 0]) for b in loader] == [2 * s + dp for s in range(5)]
    skipped = acc.skip_first_batches(loader, 3)  # a resume after 3 steps
    assert [int(b[0, 0]) for b in skipped] == [2 * s + dp for s in range(3, 5)]


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [False, True])
def test_an_accelerator_deals_a_streams_batches_by_data_parallel_rank(tmp_path, tp):
    """dp_shard 2 x cp 2 or x tp 2 on a stream (dispatched: Accelerate's default for an iterable dataset): step s
    gives both ranks of data-parallel rank d row 2 s + d, also after ``skip_first_batches`` (a resume). Accelerate
    gave rank r row 4 s + r under CP (3 steps), and under TP every row to every rank (10 steps: both data-parallel
    ranks trained on each row); its skip_first_batches rebuilt ndp's loader as Accelerate's."""
    spawn(_dealt_rank, 4, tmp_path, tp, timeout_s=60)


def _ragged_rank(rank, world):
    _rank_env(rank, world)
    plugin = _fsdp2_plugin()
    acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(dp_shard_size=2), fsdp_plugin=plugin,
                                     dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    rows = [torch.zeros(n, dtype=torch.long) for n in (8, 8, 6, 8)]
    loader = acc.prepare(torch.utils.data.DataLoader(rows, batch_size=1))
    assert len(loader) == 2
    with pytest.raises(ValueError, match=r"the batches process 0 read to deal to the data-parallel ranks cannot be "
                                         r"concatenated .* dispatch_batches=False"):
        for _ in loader:
            pass


@pytest.mark.distributed
def test_dispatched_batches_of_different_lengths_are_refused_on_every_rank(tmp_path):
    """Process 0 cannot concatenate the second pair of rows (6 and 8 tokens) to deal them: Accelerate raised there
    alone and left process 1 waiting for the batch (a hang); refused by name on both."""
    spawn(_ragged_rank, 2, tmp_path, timeout_s=60)


class _EveryRank(_InOrder):
    """A sampler of one's own over every rank (not the data-parallel ones): each TP rank its own rows."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.DistributedSampler(self.train_dataset, shuffle=False)


def _every_rank_rank(rank, world, tmp, model_dir):
    _rank_env(rank, world)
    args = _trainer_args(tmp, {"dp_shard_size": 2, "tp_size": 2}, max_steps=3)
    trainer = _EveryRank(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=_samples())
    with pytest.raises(ValueError, match=r"ndp.trainer got other rows on the 2 ranks that each take their part of one "
                                         r"batch \(the tp axis\).*num_replicas=2.*_get_train_sampler"):
        trainer.train()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))  # a loader of its own
    with pytest.raises(ValueError, match=r"maybe_context_parallel got other rows .* \(the tp axis\)"):
        with trainer.accelerator.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
            pass


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_rows_that_differ_between_the_tp_ranks_of_a_batch_are_refused_on_every_rank(tmp_path):
    """At dp_shard 2 x tp 2 (no CP) a sampler over all 4 ranks gave each TP rank other rows, which its split layers
    then mixed: the Trainer trained on it silently (losses 5.5612 / 5.5573 / 5.5513 against 5.5755 / 5.5489 /
    5.5477 with the data-parallel ranks' sampler), and so did an Accelerate loop's maybe_context_parallel. Refused
    by name on every rank before the first layer."""
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    spawn(_every_rank_rank, 4, tmp_path, str(tmp_path), model_dir, timeout_s=300)


def _patches(batch):
    """A VLM processor's batch: rows stacked, each row's image patches (3 or 5 of them) flattened into one tensor."""
    return {"input_ids": torch.stack([b[0] for b in batch]), "pixel_values": torch.cat([b[1] for b in batch])}


def _patches_rank(rank, world):
    _rank_env(rank, world)
    acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(dp_shard_size=2), fsdp_plugin=_fsdp2_plugin(),
                                     dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    rows = [(torch.full((8,), i), torch.zeros(3 + 2 * (i % 2), 4)) for i in range(4)]
    loader = acc.prepare(torch.utils.data.DataLoader(rows, batch_size=1, collate_fn=_patches))
    with pytest.raises(ValueError, match=r"holds tensors of different first dims \(\[1, 3\]\).*flattened image "
                                         r"patches.*dispatch_batches=False"):
        next(iter(loader))
    # a packed batch's document table is not dealt as rows (ndp rebuilds the shards' from the positions): dealt
    packed = [{"input_ids": torch.full((8,), i), "cu_seq_lens_q": torch.tensor([0, 3, 8])} for i in range(4)]
    loader = acc.prepare(torch.utils.data.DataLoader(packed, batch_size=1))
    assert int(next(iter(loader))["input_ids"][0, 0]) == rank


@pytest.mark.distributed
def test_dispatched_tensors_that_do_not_count_rows_are_refused_on_every_rank(tmp_path):
    """Dealing slices every tensor of process 0's batch along its first dim: a vision-language batch's flattened
    image patches (Qwen-VL's pixel_values: [patches, ...]) went to the ranks by patch count, not by row, and Qwen2-VL's
    tower crashed on a rank ("split_with_sizes expects split_sizes to sum exactly to 1") while the others went on.
    Refused by name on every rank."""
    spawn(_patches_rank, 2, tmp_path, timeout_s=60)
