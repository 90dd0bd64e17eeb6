"""A step's positions for requests with M-RoPE positions (engine/multimodal/mrope.py): every token's
one-part position shifted to its first part (the prompt's table, then the token index plus the
request's delta), and the image tokens' three parts apart for the model's cos/sin."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from bulkinfer.engine.multimodal.mrope import StepRopeRows

if TYPE_CHECKING:
    from bulkinfer.engine.scheduler import SchedulerOutput
    from bulkinfer.engine.step_batch import StepBatch, StepRows


def shifted_positions(batch: StepBatch, step: StepRows, output: SchedulerOutput) -> None:
    """Rewrite `batch.positions` in place of the token index, and set `batch.rope_rows` (nothing for a
    step whose requests all have plain positions)."""
    deltas = {chunk.request.request_id: chunk.request.rope_delta for chunk in output.chunks
              if chunk.request.rope_delta}
    if not deltas and not step.rope_rows:
        return
    positions = batch.positions.cpu().numpy().copy()
    if step.decodes is not None:  # decode columns come first, one token each, past the prompt
        for column, request_id in enumerate(step.decodes.request_ids):
            positions[column] += deltas.get(request_id, 0)
    flat_rows: list[np.ndarray] = []
    three_parts: list[np.ndarray] = []
    for row_index, request in step.rope_rows:
        row = step.rows[row_index]
        table = request.rope_positions
        assert table is not None
        count = len(row.token_ids)
        flat = np.arange(batch.row_ends[row_index] - count, batch.row_ends[row_index])
        index = np.arange(row.start, row.start + count)
        in_prompt = index < table.shape[1]
        positions[flat] = np.where(in_prompt, table[0, np.minimum(index, table.shape[1] - 1)],
                                   index + request.rope_delta)
        prompt_index = index[in_prompt]
        parts = table[:, prompt_index]
        apart = (parts[1] != parts[0]) | (parts[2] != parts[0])
        if apart.any():
            flat_rows.append(flat[in_prompt][apart])
            three_parts.append(parts[:, apart])
    device = batch.positions.device
    batch.positions = torch.from_numpy(positions).to(device)
    if flat_rows:
        batch.rope_rows = StepRopeRows(torch.from_numpy(np.concatenate(flat_rows)).to(device),
                                       torch.from_numpy(np.concatenate(three_parts, axis=1)).to(device))
