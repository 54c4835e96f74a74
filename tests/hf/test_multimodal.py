"""Vision-language models under CP with images (``ndp.hf.multimodal``): the batch reaches the model whole, the towers
run on the whole images on every rank, the text decoder takes this rank's shard; the loss and every gradient (the
vision tower's included) equal one process's, through ``ndp.hf.shard_batch`` (Qwen2-VL, Qwen3-VL, LLaVA, Mistral 3,
Idefics3, InternVL, PaliGemma; Gemma 3 and Gemma 4 with their bidirectional image blocks; Mllama's cross-attention)
and through ndp's Trainer, SFTTrainer and DPOTrainer. Before, a batch with images under CP was
refused (the tower would have seen a shard): no VLM trained under CP; Mistral 3 with images did not run even on one
process."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from accelerate.parallelism_config import ParallelismConfig as AccelerateConfig
from accelerate.state import AcceleratorState
from datasets import Dataset
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.distributed.tensor import DTensor
from transformers import (AutoConfig, AutoModelForImageTextToText, AutoTokenizer, LlavaProcessor,
                          PreTrainedTokenizerFast)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

import ndp
import ndp.accelerate
import ndp.hf
import ndp.trainer
from dist import spawn
from ndp.hf.batch import Whole, pad_rows
from ndp.hf.attention import ndp_attention_forward
from ndp.hf.multimodal import shard_decoder_inputs
from test_accelerate import _InOrder, _fsdp2_plugin, _in_order, _rank_env, _save_word_tokenizer, _trainer_args
from _zoo import _loss_and_grads, _shrink

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

IMAGE, VIDEO, START, END = 100, 101, 102, 103  # token ids inside the tiny vocabulary (128)
# Qwen-VL: each image 1 x 4 x h patches, 2 x 2 merged into h tokens; LLaVA: 28 px images of 14 px patches, 4 tokens
GRIDS = ((1, 4, 4), (1, 4, 6))


# family -> (its vision config's fields, the image's placeholder tokens, pixel_values' shape, other inputs)
_IMAGES = {
    "llava": (dict(image_size=28), 4, (2, 3, 28, 28), {}),
    "mistral3": (dict(image_size=56), 2, (2, 3, 28, 56), dict(image_sizes=torch.tensor([[28, 56], [28, 56]]))),
    "idefics3": (dict(image_size=64), 1, (2, 1, 3, 64, 64), {}),  # 4 patches of 32, scale factor 2
    "internvl": (dict(image_size=[28, 28], patch_size=[14, 14]), 1, (2, 3, 28, 28), {}),
    "paligemma": (dict(image_size=28, projection_dim=64), 4, (2, 3, 28, 28), {}),
    "gemma3": (dict(image_size=28, patch_size=14), 4, (2, 3, 28, 28), {}),  # token_type_ids: vlm_batch
    "gemma4": ({}, 64, None, {}),  # a 48 px image: 64 soft tokens (vlm_batch: its processor's patches, positions)
    # one tile of 28 px per image, attended by cross-attention (vlm_batch: the tiles' aspect ratios and mask)
    "mllama": (dict(image_size=28, patch_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_global_layers=1, attention_heads=2, max_num_tiles=1, intermediate_layers_indices=[0],
                    vision_output_dim=64, supported_aspect_ratios=[[1, 1]]), 1, (2, 1, 1, 3, 28, 28), {}),
}
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16)


def tiny_vlm(family, seed=0, **vision):
    """A float64 `family` model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, Mistral 3, Idefics3, InternVL, PaliGemma)
    shrunk as the zoo shrinks text models; `vision`: its vision config's fields set besides."""
    cfg = AutoConfig.for_model(family)
    _shrink(cfg, set())
    cfg.image_token_id, cfg.pad_token_id = IMAGE, 0
    if family.startswith("qwen"):
        cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id = VIDEO, START, END
        cfg.vision_config.out_hidden_size = 64
        cfg.get_text_config().rope_parameters["mrope_section"] = [2, 3, 3]  # head 16: 8 rotary frequencies
    else:
        cfg.image_token_index = IMAGE
        for name, value in _IMAGES[family][0].items():
            setattr(cfg.vision_config, name, value)
        if family == "idefics3":
            cfg.scale_factor = 2
        if family == "paligemma":
            cfg.projection_dim = 64
        if family == "gemma3":  # 2 x 2 patches, one token each; a window that cuts into the image blocks
            cfg.mm_tokens_per_image, cfg.boi_token_index, cfg.eoi_token_index = 4, START, END
            cfg.text_config.sliding_window = 3
        if family == "mllama":  # one cross-attention layer of the two
            cfg.text_config.cross_attention_layers = [1]
        if family == "gemma4":  # a vision tower (the config has none), its image blocks attended bidirectionally
            cfg.vision_config = Gemma4VisionConfig(**GEMMA4_VISION)
            cfg.boi_token_id, cfg.eoi_token_id = START, END
            cfg.text_config.use_bidirectional_attention = "vision"
    for name, value in vision.items():
        setattr(cfg.vision_config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float64)
    if family == "gemma3":  # its projection starts at zero (no image would reach the text, nor a gradient the tower)
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    if family == "mllama":  # its gates start at zero (the cross-attention's output, and the tower's gradient, zero)
        for name, p in model.named_parameters():
            if "gate" in name and p.numel() == 1:
                torch.nn.init.constant_(p, 0.5)
    return model


def vlm_batch(model, seq, padded=0, seed=1):
    """Two rows of `seq` tokens, an image in each (its placeholders after a start token), shifted labels (-100 at
    the image's tokens and at `padded` right pads of row 1, which the attention mask marks)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, IMAGE, (2, seq), generator=g)
    family = model.config.model_type
    qwen = family.startswith("qwen")
    tokens = [int(torch.tensor(grid).prod()) // 4 for grid in GRIDS] if qwen else [_IMAGES[family][1]] * 2
    for row, n in enumerate(tokens):
        at = 4 + 5 * row if family == "gemma3" else 4  # Gemma 3: the rows' image blocks apart (an attention call each)
        ids[row, at], ids[row, at + 1:at + 1 + n], ids[row, at + 1 + n] = START, IMAGE, END
    mask = torch.ones_like(ids)
    if padded:
        mask[1, -padded:] = 0
        ids[1, -padded:] = 0
    labels = F.pad(ids[:, 1:], (0, 1), value=-100).masked_fill(F.pad(ids[:, 1:] >= IMAGE, (0, 1)), -100)
    labels = labels.masked_fill(F.pad(mask[:, 1:] == 0, (0, 1), value=True), -100)
    if qwen:
        vc = model.config.vision_config
        grid = torch.tensor(GRIDS)
        pixels = torch.randn(int(grid.prod(-1).sum()), 3 * vc.temporal_patch_size * vc.patch_size ** 2,
                             generator=g, dtype=torch.float64)
        extra = dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())
    elif family == "gemma4":
        image = Image.fromarray((torch.rand(48, 48, 3, generator=g) * 255).to(torch.uint8).numpy())
        px = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[image, image], return_tensors="pt")
        extra = dict(pixel_values=px["pixel_values"].double(), image_position_ids=px["image_position_ids"],
                     mm_token_type_ids=(ids == IMAGE).long())
    else:
        extra = dict(pixel_values=torch.randn(_IMAGES[family][2], generator=g, dtype=torch.float64),
                     **_IMAGES[family][3])
        if family == "gemma3":  # its image blocks, attended bidirectionally
            extra["token_type_ids"] = (ids == IMAGE).long()
        if family == "mllama":  # one tile per image; each token attends to its row's image from the image on
            seen = ((ids == IMAGE).cumsum(1) > 0).long()[:, :, None, None]
            extra.update(aspect_ratio_ids=torch.ones(2, 1, dtype=torch.long),
                         aspect_ratio_mask=torch.ones(2, 1, 1, dtype=torch.long), cross_attention_mask=seen)
    return dict(input_ids=ids, attention_mask=mask, **extra), labels


def _reference(family, seq, padded):
    model = tiny_vlm(family)
    # eager: transformers' sdpa drops the causal mask where a layer says is_causal=False (PaliGemma's text layers);
    # sdpa for Gemma 3 and 4: eager fills a pad whose sliding window sees only pads with NaN in float64, and the next
    # layer spreads it over the row
    model.set_attn_implementation("sdpa" if family.startswith("gemma") else "eager")
    batch, labels = vlm_batch(model, seq, padded)
    return _loss_and_grads(model, F.cross_entropy(model(**batch).logits.flatten(0, 1), labels.flatten()))


def _shard_batch_body(rank, world, family, impl, seq, padded):
    ref_loss, ref_grads = _reference(family, seq, padded)
    cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl, cp_layout="zigzag")
    model = ndp.hf.parallelize(tiny_vlm(family).train(), cfg, cfg.build_device_mesh("cpu"))
    batch, labels = vlm_batch(model, seq, padded)
    b = ndp.hf.shard_batch(model, labels=labels, **batch)
    shard_labels = b.pop("labels")
    assert shard_labels.shape[1] == -(-seq // (2 * world)) * 2  # this rank's shard of the padded rows
    loss, mean = ndp.hf.loss(model(**b).logits, shard_labels, model, return_mean=True)
    loss.backward()
    torch.testing.assert_close(mean.double(), ref_loss, rtol=1e-6, atol=0)
    tower = 0
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = ref_grads.get(name)
        if want is None:
            assert g is None or not bool(g.abs().max() > 0), name
            continue
        scale = float(want.abs().max())
        if scale < 1e-9:  # zero in exact arithmetic (a key bias): rounding noise only
            continue
        tower += any(t in name for t in ("visual", "vision", "multi_modal_projector", "connector"))
        torch.testing.assert_close(g, want, rtol=0, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")
    assert tower > 10  # the towers' gradients are compared too


@pytest.mark.parametrize("family, impl, seq, padded", [
    ("qwen2_vl", "ring", 23, 0),  # multimodal RoPE positions from the whole rows; 23 tokens padded to 24
    ("qwen2_vl", "ring", 24, 5),  # right padding (attention mask) as a processor pads a batch
    ("qwen3_vl", "ulysses", 24, 0),  # deepstack features added to the shard's visual tokens
    ("llava", "ring", 21, 0),
    ("mistral3", "ring", 23, 0),  # Pixtral's tower keeps its own attention (its block-diagonal image mask)
    ("idefics3", "ulysses", 22, 0),
    ("internvl", "ring", 21, 0),
    ("paligemma", "ring", 22, 0),  # its positions count from 1 (refused as "not this rank's shard" before)
    ("gemma3", "ring", 23, 0),  # bidirectional image blocks, a sliding window cutting into them (refused before)
    ("gemma3", "ulysses", 24, 5),  # right padding, which shard_batch drops from the mask (pads labelled -100)
    ("gemma4", "ring", 86, 0),  # image blocks; per-layer inputs cut as the embeddings
    ("mllama", "ring", 23, 0),  # cross-attention to the tower's states; the decoder cuts input_ids and the masks
    ("mllama", "ulysses", 24, 0),
])
def test_a_batch_with_images_under_cp_equals_one_process(tmp_path, family, impl, seq, padded):
    """cp 2 through shard_batch: the loss and every gradient (the vision tower's too) equal one process's. Before:
    refused, the tower would have seen a shard (and a shard's placeholders do not match the images)."""
    spawn(_shard_batch_body, 2, tmp_path, family, impl, seq, padded, timeout_s=120)


class _Images(torch.utils.data.Dataset):
    """Rows of :func:`vlm_batch` (each with its image), as a collator's samples."""

    def __init__(self, model, rows):
        self.samples = []
        for seed in range(rows):
            batch, _ = vlm_batch(model, 23, seed=seed)
            row = seed % 2
            grid = batch["image_grid_thw"][row]
            first = int(batch["image_grid_thw"][:row].prod(-1).sum())
            self.samples.append(dict(input_ids=batch["input_ids"][row], labels=batch["input_ids"][row].masked_fill(
                batch["input_ids"][row] >= IMAGE, -100), image_grid_thw=grid,
                pixel_values=batch["pixel_values"][first:first + int(grid.prod())].float(),
                mm_token_type_ids=batch["mm_token_type_ids"][row]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def collate_images(samples):
    """Rows stacked, their images' patches concatenated (as Qwen-VL's processor gives them)."""
    out = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "labels", "mm_token_type_ids",
                                                              "image_grid_thw")}
    out["pixel_values"] = torch.cat([s["pixel_values"] for s in samples])
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    return out


def _save_vlm(model_dir):
    model = tiny_vlm("qwen2_vl")
    model.float().save_pretrained(model_dir)


def _trainer_body(rank, world, tmp, model_dir, sft):
    _rank_env(rank, world)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    data = _Images(model, 8)
    par = {"dp_shard_size": 2, "cp_size": 2}
    if sft:  # TRL's defaults: gradient checkpointing (the towers' blocks recomputed in the backward)
        args = _trainer_args(tmp, par, layer="Qwen2VLDecoderLayer", cls=SFTConfig, remove_unused_columns=False,
                             dataset_kwargs={"skip_prepare_dataset": True}, bf16=False)
        rows = Dataset.from_list([{k: v.tolist() for k, v in s.items()} for s in data.samples]).with_format("torch")
        trainer = _in_order(ndp.trainer.SFTTrainer)(model=model, args=args, train_dataset=rows,
                                                    data_collator=collate_images,
                                                    processing_class=AutoTokenizer.from_pretrained(model_dir))
    else:
        args = _trainer_args(tmp, par, layer="Qwen2VLDecoderLayer", remove_unused_columns=False,
                             per_device_eval_batch_size=1)
        trainer = _InOrder(model=model, args=args, train_dataset=data, data_collator=collate_images)
    trainer.train()
    ev = None if sft else trainer.evaluate(eval_dataset=torch.utils.data.Subset(data, range(4)))["eval_loss"]
    if rank == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        torch.save({"losses": losses, "eval": ev}, os.path.join(tmp, "vlm.pt"))


def _one_process_vlm(model_dir, data):
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        b = collate_images([data[2 * step], data[2 * step + 1]])
        labels = F.pad(b.pop("labels")[:, 1:], (0, 1), value=-100)
        loss = F.cross_entropy(model(**b).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # the Trainer's evaluation loss: the mean over its steps of each step's token mean
        steps = []
        for step in range(2):
            b = collate_images([data[2 * step], data[2 * step + 1]])
            labels = F.pad(b.pop("labels")[:, 1:], (0, 1), value=-100)
            steps.append(F.cross_entropy(model(**b).logits.flatten(0, 1), labels.flatten()).item())
    return losses, sum(steps) / len(steps)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sft", [False, True], ids=["trainer", "trl-sft"])
def test_the_trainer_trains_a_vision_language_model_under_cp_as_one_process(tmp_path, sft):
    """ndp.trainer.Trainer (and TRL's SFTTrainer, gradient checkpointing on) at dp_shard 2 x cp 2 on Qwen2-VL with
    an image in every row (each data-parallel rank's batch whole on its CP ranks, the rows padded 23 -> 24): the 3
    logged losses and the Trainer's evaluation loss after training equal one process taking both data-parallel
    ranks' rows. With gradient checkpointing the vision blocks, recomputed in the backward, were refused as if they
    ran on a shard."""
    model_dir = str(tmp_path / "model")
    _save_vlm(model_dir)
    _save_word_tokenizer(model_dir)
    spawn(_trainer_body, 4, tmp_path, str(tmp_path), model_dir, sft, timeout_s=300)
    got = torch.load(tmp_path / "vlm.pt")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    losses, ev = _one_process_vlm(model_dir, _Images(model, 8))
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(losses, abs=1e-4)  # logged to 4 digits
    if not sft:
        assert got["eval"] == pytest.approx(ev, rel=1e-5)


def _packed_body(rank, world):
    cfg = ndp.ParallelismConfig(cp_size=world)
    model = ndp.hf.parallelize(tiny_vlm("qwen2_vl").train(), cfg, cfg.build_device_mesh("cpu"))
    batch, labels = vlm_batch(model, 24)
    batch.pop("attention_mask")
    position_ids = torch.cat([torch.arange(12), torch.arange(12)]).expand(2, 24)  # two documents in each row
    with pytest.raises(ndp.hf.Unsupported, match=r"packed documents with images .* Pad the rows"):
        ndp.hf.shard_batch(model, labels=labels, position_ids=position_ids, **batch)


def test_packed_documents_with_images_under_cp_are_refused_on_every_rank(tmp_path):
    """The text decoder cuts a whole batch as rows: packed documents would not be the shard's."""
    spawn(_packed_body, 2, tmp_path, timeout_s=60)


def test_a_batch_with_images_passes_through_shard_batch_without_cp():
    """Without CP (one training loop for every layout), shard_batch hands a batch with images back whole, its labels
    marked shifted: the model's loss equals its loss on the shifted labels. Before: refused ("shard_batch takes
    [batch, seq] tensors; ['pixel_values'] are not")."""
    model = tiny_vlm("qwen2_vl")
    batch, labels = vlm_batch(model, 23)
    want = F.cross_entropy(model(**batch).logits.flatten(0, 1), labels.flatten())
    model = ndp.hf.parallelize(model, ndp.ParallelismConfig(), None)
    got = ndp.hf.shard_batch(model, labels=labels, **batch)
    assert sorted(got) == sorted([*batch, "labels"]) and got["pixel_values"] is batch["pixel_values"]
    torch.testing.assert_close(model(**got).loss.double(), want, rtol=1e-6, atol=0)  # the loss in float32


def _draws_body(rank, world, tp):
    cfg = ndp.ParallelismConfig(cp_size=world // tp, tp_size=tp)
    mesh = cfg.build_device_mesh("cpu")
    model = ndp.hf.parallelize(tiny_vlm("internvl", hidden_dropout_prob=0.5).train(), cfg, mesh)
    batch, labels = vlm_batch(model, 21)
    torch.manual_seed(100 + rank)  # each rank its own stream, as a loop may seed them
    b = ndp.hf.shard_batch(model, labels=labels, **batch)
    b.pop("labels")
    own = torch.Generator()
    own.set_state(torch.get_rng_state())
    if tp == 1 or torch.distributed.get_process_group_ranks(mesh["tp"].get_group())[0] == rank:
        # the towers' seed each rank draws (the first rank's is used); under TP from TP rank 0's streams, which
        # the forward runs on: the other TP ranks' come back untouched (ndp.parallel.draws)
        torch.randint(2 ** 62, (1,), generator=own)
    got = _projected(model, b)
    mine = torch.get_rng_state()
    everyone = [torch.empty_like(got) for _ in range(world)]
    torch.distributed.all_gather(everyone, got)
    assert all(torch.equal(f, everyone[0]) for f in everyone)  # the towers drew alike on every rank (CP and TP)
    with torch.no_grad():
        assert not torch.allclose(got, _projected(model.eval(), ndp.hf.shard_batch(model, **batch)))  # they drew
    assert torch.equal(mine, own.get_state())  # the rank's own stream again after the towers


@pytest.mark.parametrize("world, tp", [(2, 1), (4, 2)], ids=["cp2", "cp2-tp2"])
def test_a_towers_random_draws_are_alike_on_every_rank_holding_the_batch(tmp_path, world, tp):
    """In training, a tower's dropout (or drop-path) draws once for the batch, as on one process, on every CP and TP
    rank. Before, each rank drew its own: one image's tokens carried features of different draws on different CP
    ranks, and a TP rank's decoder got another input than its peers'."""
    spawn(_draws_body, world, tmp_path, tp, timeout_s=180)


def _projected(model, batch):
    """The projector's output of one forward of `model` on `batch`."""
    features = []
    hook = model.model.multi_modal_projector.register_forward_hook(lambda m, args, out: features.append(out.detach()))
    model(**batch)
    hook.remove()
    return features[0]


def _tp_draws_body(rank, world, tmp):
    cfg = ndp.ParallelismConfig(tp_size=world)
    model = ndp.hf.parallelize(tiny_vlm("internvl", hidden_dropout_prob=0.5).train(), cfg,
                               cfg.build_device_mesh("cpu"))
    batch, labels = vlm_batch(model, 21)
    torch.manual_seed(100 + rank)
    own = torch.get_rng_state()
    got = _projected(model, ndp.hf.shard_batch(model, **batch))
    mine = torch.get_rng_state()
    ref = tiny_vlm("internvl", hidden_dropout_prob=0.5).train()
    torch.manual_seed(100)  # TP rank 0's seed
    want = _projected(ref, batch)
    after = torch.get_rng_state()
    assert torch.equal(got, want)  # the tower's masks of one process seeded like TP rank 0, on every TP rank
    assert not torch.equal(want, _projected(ref.eval(), batch))  # and it drew
    # after the forward TP rank 0's stream is where one process's is; the other rank's is its own
    assert torch.equal(mine, after if rank == 0 else own)


def test_under_tp_alone_a_towers_draws_are_one_process_seeded_like_tp_rank_0(tmp_path):
    """tp 2 without CP (the batch whole on each rank), each rank seeded its own: the tower's dropout draws TP rank 0's
    masks on both ranks (ndp.parallel.draws). Before, each TP rank's tower drew its own, and the text decoders' copies
    took different inputs."""
    spawn(_tp_draws_body, 2, tmp_path, str(tmp_path), timeout_s=180)


def test_a_tower_keeps_its_own_attention():
    """ndp's attention runs in the text decoder only; a tower keeps its implementation and its own masks. Before,
    Pixtral's block-diagonal image mask reached ndp's attention, which refused it: Mistral 3 with images did not run
    even on one process."""
    model = tiny_vlm("mistral3")
    batch, _ = vlm_batch(model, 23)
    want = model(**batch).logits
    model = ndp.hf.parallelize(model, ndp.ParallelismConfig(), None)
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert model.config.text_config._attn_implementation == "ndp_ring"
    torch.testing.assert_close(model(**batch).logits, want, rtol=1e-10, atol=1e-12)


class _Ctx:
    size, rank, layout, impl = 2, 0, "zigzag", "ring"


def test_decoder_arguments_ndp_cannot_cut_are_refused_by_name():
    """What the text decoder gets along the sequence besides the embeddings (or input_ids), positions, a 2-D mask,
    per-layer inputs, cross-attention masks and placed visual features is refused, never passed on whole beside a
    shard: another per-token tensor, a dense mask, features that do not match their mask, rows at another dim,
    positional inputs."""
    whole = Whole(torch.ones(2, 4), torch.tensor([8]), 8)
    embeds = torch.zeros(2, 8, 16)
    cases = [
        ({"inputs_embeds": embeds, "per_layer_inputs": torch.zeros(8, 2, 3, 4)},
         r"per_layer_inputs \(8, 2, 3, 4\) .* cuts it along dim 1"),
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "cross_attention_mask": torch.zeros(2, 1, 5, 8)},
         r"cross_attention_mask \(2, 1, 5, 8\) .* along dim 2"),
        ({"inputs_embeds": embeds, "extra": [{"rows": torch.zeros(2, 8)}]}, r"extra \(2, 8\) along the batch's 8"),
        ({"inputs_embeds": embeds, "attention_mask": torch.zeros(2, 1, 8, 8)}, r"dense attention mask \(2, 1, 8, 8\)"),
        ({"inputs_embeds": embeds, "visual_pos_masks": torch.ones(2, 8, dtype=torch.bool),
          "deepstack_visual_embeds": [torch.zeros(15, 16)]},
         r"deepstack_visual_embeds \[\(15, 16\)\] for a mask of 16"),
        ({"inputs_embeds": embeds[:, :6]}, r"not as inputs_embeds \[batch, 8, hidden\] or input_ids \[batch, 8\]"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ndp.hf.Unsupported, match=match):
            shard_decoder_inputs(torch.nn.Identity(), (), kwargs, whole, _Ctx())
    out = shard_decoder_inputs(torch.nn.Identity(), (), {"inputs_embeds": embeds, "cache_position": torch.arange(8),
                                                         "visual_pos_masks": torch.arange(8).expand(2, 8) % 3 == 0,
                                                         "deepstack_visual_embeds": [torch.arange(6.)[:, None]]},
                               whole, _Ctx())
    assert "cache_position" not in out and out["inputs_embeds"].shape == (2, 4, 16)
    assert out["position_ids"].tolist() == [[0, 1, 6, 7]] * 2  # zigzag: rank 0 holds pieces 0 and 3 of 4
    assert out["visual_pos_masks"].tolist() == [[True, False, True, False]] * 2  # positions 0 and 6 of each row
    assert out["deepstack_visual_embeds"][0].flatten().tolist() == [0., 2., 3., 5.]  # their features, in order
    # Gemma 4's per-layer inputs along dim 1; Mllama's input_ids (its decoder embeds them) and cross-attention masks
    rows = torch.arange(8.)[None, None, :, None]
    given = {"input_ids": torch.arange(8).expand(2, 8), "per_layer_inputs": rows[0].expand(2, 8, 3).unsqueeze(-1),
             "cross_attention_mask": rows.expand(2, 1, 8, 5), "full_text_row_masked_out_mask": rows.expand(2, 1, 8, 1)}
    out = shard_decoder_inputs(torch.nn.Identity(), (), given, whole, _Ctx())
    assert out["input_ids"].tolist() == [[0, 1, 6, 7]] * 2
    assert out["per_layer_inputs"][0, :, 0, 0].tolist() == [0., 1., 6., 7.]
    assert out["cross_attention_mask"][0, 0, :, 0].tolist() == [0., 1., 6., 7.]
    assert out["full_text_row_masked_out_mask"][1, 0, :, 0].tolist() == [0., 1., 6., 7.]


def _accelerate_body(rank, world):
    _rank_env(rank, world)
    acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(cp_size=world),
                                     fsdp_plugin=_fsdp2_plugin("Qwen2VLDecoderLayer"))
    model = acc.prepare(tiny_vlm("qwen2_vl"))
    batch, labels = vlm_batch(model, 24)
    ids = batch.pop("input_ids")
    with acc.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers={ids, labels}):
        with pytest.raises(ndp.hf.Unsupported, match=r"inside maybe_context_parallel, which shards the buffers before "
                                                     r"the model.*ndp.hf.shard_batch"):
            model(input_ids=ids, shift_labels=labels, **batch)


def test_images_inside_maybe_context_parallel_are_refused_on_every_rank(tmp_path):
    """An Accelerate loop shards its buffers in place before the model: the placeholders of a rank's shard would
    not match the images (a rank whose shard held none raised in transformers while the others went on into the
    ring). Refused by name on every rank before the towers run."""
    spawn(_accelerate_body, 2, tmp_path, timeout_s=60)


def _llava_processor():
    """LLaVA's processor on the word tokenizer (t0 .. t127, <image> at IMAGE) and CLIP's PIL image processor at 28 px:
    each image 4 placeholders."""
    vocab = {f"t{i}": i for i in range(128) if i != IMAGE}
    vocab["<image>"] = IMAGE
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1",
                                        extra_special_tokens={"image_token": "<image>"})
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def _image_rows(seed, rows, kind):
    """A dataset with an image in every row: prompt words around it and completions of uneven lengths (pads in every
    batch): a prompt-completion dataset (SFT), or DPO's pairs (chosen, rejected)."""
    g = np.random.RandomState(seed)

    def words(lo, hi):
        return " ".join(f"t{i}" for i in g.randint(2, IMAGE - 1, g.randint(lo, hi)))

    data = {"images": [[Image.fromarray((g.rand(28, 28, 3) * 255).astype("uint8"))] for _ in range(rows)],
            "prompt": [f"{words(3, 8)} <image> {words(2, 5)}" for _ in range(rows)]}
    for name in ("chosen", "rejected") if kind == "dpo" else ("completion",):
        data[name] = [" " + words(3, 12) for _ in range(rows)]
    return Dataset.from_dict(data)


def _trl(kind, ndp_trainer, tmp, model_dir, par=None):
    """TRL's trainer of `kind` (ndp's under ParallelismConfig(**par), else TRL's on one process) on the LLaVA in
    model_dir through TRL's vision collator and LLaVA's processor: 3 unclipped SGD steps of one row (pair), then an
    evaluation of 3; SFT with its default gradient checkpointing."""
    config, trainer = (DPOConfig, DPOTrainer) if kind == "dpo" else (SFTConfig, SFTTrainer)
    cls = getattr(ndp.trainer, trainer.__name__) if ndp_trainer else trainer
    args = _trainer_args(tmp, par, cls=config, per_device_eval_batch_size=1, bf16=False, learning_rate=0.1,
                         max_grad_norm=0.0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                        attn_implementation=None if par else "eager")
    return _in_order(cls)(model=model, args=args, train_dataset=_image_rows(1, 6, kind),
                    eval_dataset=_image_rows(2, 3, kind), processing_class=_llava_processor())


def _trl_log(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "eval": trainer.evaluate()["eval_loss"],
            "logps": [v for h in logs for v in (h.get("logps/chosen"), h.get("logps/rejected")) if v is not None]}


def _trl_body(rank, world, tmp, model_dir, kind):
    _rank_env(rank, world)
    trainer = _trl(kind, True, tmp, model_dir, {"cp_size": world})
    trainer.train()
    log = _trl_log(trainer)
    if rank == 0:
        torch.save(log, os.path.join(tmp, "trl.pt"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_on_images_under_cp_equals_trl_on_one_process(tmp_path, kind):
    """TRL's SFT and DPO on LLaVA with an image in every row (TRL's vision collators, LLaVA's processor) at cp 2: the
    batch (DPO: each model call's rows) reaches the model whole with its images: the losses, the evaluation loss and
    DPO's chosen / rejected log-probabilities equal TRL's on one process. Before, the image placeholders were
    sharded with the rows (refused, or a crash on some ranks)."""
    model_dir = str(tmp_path / "model")
    tiny_vlm("llava").float().save_pretrained(model_dir)
    spawn(_trl_body, 2, tmp_path, str(tmp_path), model_dir, kind, timeout_s=300)
    got = torch.load(tmp_path / "trl.pt")
    reference = _trl(kind, False, str(tmp_path / "ref"), model_dir)
    reference.train()
    want = _trl_log(reference)
    AcceleratorState._reset_state(True)
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5)
    assert len(got["logps"]) == (6 if kind == "dpo" else 0) and got["logps"] == pytest.approx(want["logps"], rel=1e-5)


def test_token_type_rows_are_padded_as_text():
    """A processor's token types (Qwen-VL's mm_token_type_ids, Gemma 3's token_type_ids) pad as text (0), never as
    the pad token's id (Qwen's 151643 would be a modality of its own)."""
    rows = {"input_ids": torch.ones(1, 3, dtype=torch.long), "mm_token_type_ids": torch.ones(1, 3, dtype=torch.long)}
    out = pad_rows(rows, 4, pad_id=151643)
    assert out["input_ids"].tolist() == [[1, 1, 1, 151643]] and out["mm_token_type_ids"].tolist() == [[1, 1, 1, 0]]


def test_compiled_layers_follow_each_batchs_image_blocks():
    """Gemma 3's decoder layers compiled fullgraph: each batch's image blocks (spans read into the mask marker's spec,
    images at other positions in the second batch) give eager's logits and gradients, never spans compiled in from
    an earlier batch."""
    import torch._dynamo as dynamo

    ndp.hf.register_attention()
    model = tiny_vlm("gemma3").float()
    model.set_attn_implementation(ndp.hf.text_attention(model, "ndp_ring"))
    batches = [vlm_batch(model, 23, seed=seed)[0] for seed in (1, 2)]
    batches[1]["input_ids"] = batches[1]["input_ids"].roll(7, dims=1)  # the images 7 tokens later
    batches[1]["token_type_ids"] = batches[1]["token_type_ids"].roll(7, dims=1)

    def run(batch):
        model.zero_grad()
        out = model(**{k: v.float() if v.is_floating_point() else v for k, v in batch.items()}).logits
        out.square().mean().backward()
        return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager = [run(b) for b in batches]
    layers = model.model.language_model.layers
    dynamo.reset()
    try:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend="aot_eager", fullgraph=True)
        for b, want in zip(batches, eager):
            for got, w in zip(run(b), want):
                torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    finally:
        dynamo.reset()


def _cross_attention_sharded_body(rank, world):
    cfg = ndp.ParallelismConfig(cp_size=world, cp_impl="ring")
    model = ndp.hf.parallelize(tiny_vlm("mllama").train(), cfg, cfg.build_device_mesh("cpu"))
    cross = model.model.language_model.layers[1].cross_attn
    q, kv = torch.randn(1, 4, 6, 16, dtype=torch.float64), torch.randn(1, 4, 5, 16, dtype=torch.float64)
    # no whole batch around the call: the tower's states would be a shard's; refused on every rank
    with pytest.raises((ndp.hf.Unsupported, ValueError), match="a cross-attention.* on a batch sharded before"):
        ndp_attention_forward(cross, q, kv, kv, None)


def test_a_cross_attention_on_a_sharded_batch_is_refused_on_every_rank(tmp_path):
    spawn(_cross_attention_sharded_body, 2, tmp_path, timeout_s=120)


def _tiny_kosmos2_5():
    cfg = AutoConfig.for_model("kosmos-2.5")
    _shrink(cfg, set())
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(cfg, dtype=torch.float64)


def _counted_positions_body(rank, world):
    cfg = ndp.ParallelismConfig(cp_size=world, cp_impl="ring", cp_layout="zigzag")
    model = ndp.hf.parallelize(_tiny_kosmos2_5().train(), cfg, cfg.build_device_mesh("cpu"))
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = ndp.hf.shard_batch(model, input_ids=ids, labels=F.pad(ids[:, 1:], (0, 1), value=-100))
    labels = batch.pop("labels")
    with pytest.raises(ndp.hf.Unsupported, match=r"numbers the positions itself \(from padding_idx=0 \+ 1"):
        ndp.hf.loss(model(**batch).logits, labels, model)


def test_a_model_that_numbers_its_positions_computes_another_model_with_the_shards_positions():
    """Kosmos-2.5's text positions count from padding_idx + 1 when none are given and are taken as given otherwise:
    the shard's positions (0, 1, ...) would be another model (before: under cp 2 its gradients were up to 3.1x their
    scale off one process's, silently). Refused on every rank, before any attention runs."""
    model = _tiny_kosmos2_5().eval()
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        given = model(input_ids=ids, position_ids=torch.arange(24).expand(2, 24).contiguous()).logits
    assert float((own - given).abs().max()) > 0.1 * float(own.abs().max())  # the positions ndp would give differ
    assert ndp.hf.models.counted_positions(model) == ["text_model.model.embed_positions"]


def test_a_model_that_numbers_its_positions_is_refused_under_cp_on_every_rank(tmp_path):
    spawn(_counted_positions_body, 2, tmp_path, timeout_s=120)
