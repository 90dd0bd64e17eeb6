"""Qwen2.5-VL: a windowed ViT (2-D rotary, RMSNorm, SwiGLU) whose 2 x 2 neighbouring patches a merger
folds into one row of the decoder's width, and a Qwen2 decoder with M-RoPE (engine/multimodal/mrope.py).

An image's patches run in windows of `window_size` pixels (112: 4 x 4 merged rows) except in the
`fullatt_block_indexes` layers, which attend over the whole image; the patches are put in window
order first and the merged rows put back in the image's order last. Several images run in one call,
each attending only within itself. Tensor names: transformers 5's (`model.visual.*`,
`model.language_model.*`) or the published checkpoints' (`visual.*`, `model.*`), both read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bulkinfer.engine.attention import AttentionBackend
from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig, UnsupportedModelError
from bulkinfer.engine.models.module_list import ModuleSeq
from bulkinfer.engine.multimodal.inputs import MultiModalItem
from bulkinfer.engine.multimodal.mrope import mrope_cos_sin

VISUAL, TEXT, OURS = "visual.", "model.language_model.", "model."


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int = 3
    rope_theta: float = 10000.0

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> QwenVisionConfig:
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"vision hidden_act {cfg['hidden_act']!r} is not supported (only silu)"
            )
        rope = cfg.get("rope_parameters") or {}
        return QwenVisionConfig(
            depth=int(cfg["depth"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=int(cfg["num_heads"]),
            out_hidden_size=int(cfg["out_hidden_size"]),
            patch_size=int(cfg.get("patch_size", 14)),
            spatial_merge_size=int(cfg.get("spatial_merge_size", 2)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            window_size=int(cfg.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in cfg.get("fullatt_block_indexes", ())),
            in_channels=int(cfg.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class Qwen25VLConfig(LlamaFamilyConfig):
    vision: QwenVisionConfig | None = None
    mrope_section: tuple[int, ...] = ()
    image_token_id: int = -1

    @staticmethod
    def from_hf_dict(architecture: str, cfg: dict[str, Any]) -> Qwen25VLConfig:
        # transformers 5 nests the decoder's fields in text_config; published checkpoints keep them on top.
        text_cfg = dict(cfg.get("text_config") or cfg)
        rope = dict(
            text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or cfg.get("rope_scaling") or {}
        )
        sections = tuple(int(n) for n in rope.get("mrope_section", ()))
        if not sections:
            raise UnsupportedModelError("a Qwen2.5-VL config needs rope mrope_section")
        theta = float(rope.get("rope_theta", text_cfg.get("rope_theta", cfg.get("rope_theta", 1000000.0))))
        text_cfg = {**text_cfg, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
        text_cfg.pop("rope_scaling", None)
        text_cfg.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        text = LlamaFamilyConfig.from_hf_dict("Qwen2ForCausalLM", text_cfg)  # q/k/v biases as Qwen2
        fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(LlamaFamilyConfig)}
        fields["architecture"] = architecture
        if sum(sections) != text.head_dim // 2:
            raise UnsupportedModelError(
                f"mrope_section {list(sections)} does not cover head_dim / 2 = {text.head_dim // 2}"
            )
        return Qwen25VLConfig(
            **fields,
            vision=QwenVisionConfig.from_hf_dict(cfg.get("vision_config") or {}),
            mrope_section=sections,
            image_token_id=int(cfg["image_token_id"]),
        )


class VisionRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.norm1, self.norm2 = VisionRMSNorm(h), VisionRMSNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.gate_proj = nn.Linear(h, config.intermediate_size)
        self.up_proj = nn.Linear(h, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, h)

    def forward(
        self, x: torch.Tensor, segments: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).reshape(rows, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outputs = [
            F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
            for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments), strict=True)
        ]
        x = x + self.proj(torch.cat(outputs, dim=1).transpose(0, 1).reshape(rows, -1))
        y = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' vision rotary, in fp32: x * cos + rotate_half(x) * sin over cat(freqs, freqs)."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class QwenVisionTower(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(
            config.patch_values, config.hidden_size, bias=False
        )  # a Conv3d over one patch
        self.blocks: ModuleSeq[VisionBlock] = ModuleSeq(VisionBlock(config) for _ in range(config.depth))
        merged = config.hidden_size * config.spatial_merge_size**2
        self.merger_norm = VisionRMSNorm(config.hidden_size)
        self.merger_fc1, self.merger_fc2 = (
            nn.Linear(merged, merged),
            nn.Linear(merged, config.out_hidden_size),
        )
        head_dim = config.hidden_size // config.num_heads
        quarter = head_dim // 2
        # On the CPU whatever the build device (the loader builds on meta); a plain attribute, never rounded.
        exponents = torch.arange(0, quarter, 2, dtype=torch.float, device="cpu") / quarter
        self.inv_freq = 1.0 / (config.rope_theta**exponents)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Patches [N, C*T*P*P] of images with these (rows, columns) patch grids -> merged rows
        [N / merge², out hidden], image after image, each in its row-major order."""
        c, unit = self.config, self.config.spatial_merge_size**2
        order, windows, wholes, positions = _layout(grids, c)
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        x = x.reshape(-1, unit, x.shape[-1])[order].reshape(x.shape)  # window order, merge groups kept
        pos = positions.reshape(-1, unit, 2)[order].reshape(-1, 2)
        freqs = pos[..., None].float() * self.inv_freq.to(x.device)  # [N, 2, quarter/2]
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        for index, block in enumerate(self.blocks):
            x = block(x, wholes if index in c.fullatt_block_indexes else windows, cos, sin)
        merged = self.merger_fc2(
            F.gelu(self.merger_fc1(self.merger_norm(x).reshape(-1, c.hidden_size * unit)))
        )
        return merged[torch.argsort(order)]


def _layout(
    grids: Sequence[tuple[int, int]], c: QwenVisionConfig
) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """For images of these patch grids: the merge groups' window order, the window and whole-image
    segment lengths (in patches) in that order, and each patch's (row, column) in merge-group order."""
    m, unit = c.spatial_merge_size, c.spatial_merge_size**2
    per_window = c.window_size // m // c.patch_size
    order, windows, wholes, positions = [], [], [], []
    first = 0
    for rows, columns in grids:
        h, w = rows // m, columns // m
        index = torch.arange(h * w).reshape(h, w)
        for top in range(0, h, per_window):
            for left in range(0, w, per_window):
                window = index[top : top + per_window, left : left + per_window].reshape(-1)
                order.append(window + first)
                windows.append(len(window) * unit)
        wholes.append(h * w * unit)
        first += h * w
        row_ids = torch.arange(rows)[:, None].expand(rows, columns)
        column_ids = torch.arange(columns)[None, :].expand(rows, columns)
        grouped = [ids.reshape(h, m, w, m).transpose(1, 2).reshape(-1) for ids in (row_ids, column_ids)]
        positions.append(torch.stack(grouped, dim=-1))
    return torch.cat(order), windows, wholes, torch.cat(positions)


class Qwen25VLForConditionalGeneration(LlamaForCausalLM):
    config_class = Qwen25VLConfig
    config: Qwen25VLConfig

    def __init__(self, config: Qwen25VLConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        assert config.vision is not None
        self.vision_tower = QwenVisionTower(config.vision)
        self.vision_tower.requires_grad_(False)

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    def fits_native_decode(self) -> bool:
        return True  # decode rows are text: one-part rotary at shifted positions

    def step_rope(
        self, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The image rows' cos/sin from their three-part positions (the rest stay one-part)."""
        rows = self.step_rows.rope_rows
        if rows is None:
            return rope
        cos, sin = mrope_cos_sin(self.rotary.inv_freq, rows.positions, self.config.mrope_section, dtype)
        return rope[0].index_copy(0, rows.flat_index, cos), rope[1].index_copy(0, rows.flat_index, sin)

    def embed_images(self, items: Sequence[MultiModalItem], device: torch.device) -> torch.Tensor:
        m = self.vision_tower.config.spatial_merge_size
        grids = []
        for item in items:
            assert item.grid is not None
            grids.append((item.grid[0] * m, item.grid[1] * m))
        return self.vision_tower(torch.cat([item.pixel_values for item in items]).to(device), grids)

    @staticmethod
    def normalize_tensor_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers 5's names (`model.visual.`, `model.language_model.`) as the published ones."""
        renamed = {}
        for name, tensor in tensors.items():
            if name.startswith("model.visual."):
                name = name[len("model.") :]
            elif name.startswith(TEXT):
                name = OURS + name[len(TEXT) :]
            renamed[name] = tensor
        return renamed

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_hf_tensors()
        c = self.vision_tower.config
        h, inner, merged = c.hidden_size, c.intermediate_size, c.hidden_size * c.spatial_merge_size**2
        shapes[VISUAL + "patch_embed.proj.weight"] = (
            h,
            c.in_channels,
            c.temporal_patch_size,
            c.patch_size,
            c.patch_size,
        )
        for i in range(c.depth):
            pre = f"{VISUAL}blocks.{i}."
            shapes.update(
                {
                    pre + "norm1.weight": (h,),
                    pre + "norm2.weight": (h,),
                    pre + "attn.qkv.weight": (3 * h, h),
                    pre + "attn.qkv.bias": (3 * h,),
                    pre + "attn.proj.weight": (h, h),
                    pre + "attn.proj.bias": (h,),
                }
            )
            for name, out_dim, in_dim in (
                ("gate_proj", inner, h),
                ("up_proj", inner, h),
                ("down_proj", h, inner),
            ):
                shapes[f"{pre}mlp.{name}.weight"], shapes[f"{pre}mlp.{name}.bias"] = (
                    (out_dim, in_dim),
                    (out_dim,),
                )
        shapes.update(
            {
                VISUAL + "merger.ln_q.weight": (h,),
                VISUAL + "merger.mlp.0.weight": (merged, merged),
                VISUAL + "merger.mlp.0.bias": (merged,),
                VISUAL + "merger.mlp.2.weight": (c.out_hidden_size, merged),
                VISUAL + "merger.mlp.2.bias": (c.out_hidden_size,),
            }
        )
        return shapes

    @torch.no_grad()
    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_hf_tensors({name: t for name, t in tensors.items() if not name.startswith(VISUAL)})
        tower = self.vision_tower
        tower.patch_embed.weight.copy_(
            tensors[VISUAL + "patch_embed.proj.weight"].reshape(tower.patch_embed.weight.shape)
        )
        for i, block in enumerate(tower.blocks):
            pre = f"{VISUAL}blocks.{i}."
            for ours, theirs in (("norm1", "norm1"), ("norm2", "norm2")):
                getattr(block, ours).weight.copy_(tensors[f"{pre}{theirs}.weight"])
            for ours, theirs in (
                ("qkv", "attn.qkv"),
                ("proj", "attn.proj"),
                ("gate_proj", "mlp.gate_proj"),
                ("up_proj", "mlp.up_proj"),
                ("down_proj", "mlp.down_proj"),
            ):
                getattr(block, ours).weight.copy_(tensors[f"{pre}{theirs}.weight"])
                getattr(block, ours).bias.copy_(tensors[f"{pre}{theirs}.bias"])
        tower.merger_norm.weight.copy_(tensors[VISUAL + "merger.ln_q.weight"])
        for ours, theirs in (("merger_fc1", "mlp.0"), ("merger_fc2", "mlp.2")):
            getattr(tower, ours).weight.copy_(tensors[f"{VISUAL}merger.{theirs}.weight"])
            getattr(tower, ours).bias.copy_(tensors[f"{VISUAL}merger.{theirs}.bias"])
