"""N recurrent layers (GRU, LSTM): the loop over time is part of what a call does.

vmap cannot fuse them (torch has no batching rule for aten::gru or aten::lstm), so both
strategies are written out:

* 'fused_cell': the input projections of every time step and every model in one batched
  matmul, then the recurrence step by step, each step one batched matmul over the N models'
  hidden states and the gates elementwise on all N at once;
* 'block_diagonal': the N models as one recurrent layer of N times the width, whose weights
  are block diagonal (model i's hidden units see only model i's inputs and hidden units), run
  by torch's own fused GRU/LSTM kernel (cuDNN on a GPU). It does N times the flops of the N
  models; what it saves is N-1 kernel sequences.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core.errors import WideTesseraError
from ..core.job import SweepParams, Work
from ..core.layout import load_joined
from .alike import shared_config
from .base import WideOp, itemsize
from .registry import register

__all__ = ["WideGRU", "WideLSTM"]


class _WideRNN(WideOp, nn.Module):
    """N single-direction recurrent layers. Wide layout: inputs stacked, [N, B, T, I] (or
    [N, T, B, I] when batch_first is False, as the models take them); the output is the
    models' (output, state) with every tensor stacked on a leading N axis: output
    [N, B, T, H], h_n [N, layers, B, H] (and for an LSTM c_n alike).

    Parameters keep torch's names (weight_ih_l0, ...), each stacked over the N models.
    A subclass sets GATES, FUSES, `_cell`, `_native` (torch's fused layer) and the state's form.
    """

    GATES: ClassVar[int]
    BENCHMARK_STRATEGIES = ("fused_cell", "block_diagonal")
    STACKED_ARGS = 2  # the input, and the initial state stacked as the final one is given back
    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], batch=[4], seq_len=[8], hidden=[32], dtype=["float32"]),
        "quick": SweepParams.of([1, 2, 4, 8, 16], batch=[8], seq_len=[32], hidden=[64], dtype=["float32", "bfloat16"]),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32, 64],
            batch=[8, 64],
            seq_len=[16, 128, 512],
            hidden=[64, 256],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }

    def __init__(
        self,
        n: int,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        strategy: Optional[str] = None,
    ):
        super().__init__()
        self.n, self.input_size, self.hidden_size, self.num_layers = n, input_size, hidden_size, num_layers
        self.bias, self.batch_first = bias, batch_first
        self.strategy = self.check_strategy(strategy)
        rows = self.GATES * hidden_size
        for layer in range(num_layers):
            cols = input_size if layer == 0 else hidden_size
            self.register_parameter(f"weight_ih_l{layer}", nn.Parameter(torch.empty(n, rows, cols)))
            self.register_parameter(f"weight_hh_l{layer}", nn.Parameter(torch.empty(n, rows, hidden_size)))
            if bias:
                self.register_parameter(f"bias_ih_l{layer}", nn.Parameter(torch.empty(n, rows)))
                self.register_parameter(f"bias_hh_l{layer}", nn.Parameter(torch.empty(n, rows)))

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "_WideRNN":
        config = shared_config(modules, cls.FUSES, _describe_rnn)
        if config.pop("bidirectional") or config.pop("dropout") or config.pop("proj_size", 0):
            raise WideTesseraError(
                f"{cls.__name__} fuses single-direction {cls.FUSES.__name__}s without dropout or projections only"
            )
        return load_joined(cls(len(modules), strategy=strategy, **config), modules)

    def _layer_parameters(self, layer: int) -> List[torch.Tensor]:
        names = ["weight_ih", "weight_hh", "bias_ih", "bias_hh"][: 4 if self.bias else 2]
        return [getattr(self, f"{name}_l{layer}") for name in names]

    def forward(self, x: torch.Tensor, state: Any = None) -> Tuple[torch.Tensor, Any]:
        if x.dim() != 4 or x.shape[0] != self.n or x.shape[-1] != self.input_size:
            raise WideTesseraError(
                f"{type(self).__name__}: input of shape {tuple(x.shape)}; expected [{self.n}, batch, time, "
                f"{self.input_size}]"
                f" (or [{self.n}, time, batch, {self.input_size}] for batch_first=False)"
            )
        if not self.batch_first:
            x = x.transpose(1, 2)
        if state is None:
            zeros = x.new_zeros(self.n, self.num_layers, x.shape[1], self.hidden_size)
            state = self._state(zeros, zeros)
        run = self._fused_cell if self.strategy == "fused_cell" else self._one_wide_layer
        out, state = run(x, state)
        return (out if self.batch_first else out.transpose(1, 2)), state

    def _fused_cell(self, x: torch.Tensor, state: Any) -> Tuple[torch.Tensor, Any]:
        finals = []
        for layer in range(self.num_layers):
            w_ih, w_hh, *biases = self._layer_parameters(layer)
            # [N, B, T, I] @ [N, 1, I, G*H]: every step's input projection at once
            projected = torch.matmul(x, w_ih.transpose(1, 2).unsqueeze(1))
            if biases:
                projected = projected + biases[0][:, None, None]
            carried = self._layer_state(state, layer)
            steps = []
            for t in range(x.shape[2]):
                recurrent = torch.bmm(carried[0], w_hh.transpose(1, 2))
                if biases:
                    recurrent = recurrent + biases[1].unsqueeze(1)
                carried = self._cell(projected[:, :, t], recurrent, carried)
                steps.append(carried[0])
            x = torch.stack(steps, 2)
            finals.append(carried)
        return x, self._state(*(torch.stack(parts, 1) for parts in zip(*finals)))

    def _one_wide_layer(self, x: torch.Tensor, state: Any) -> Tuple[torch.Tensor, Any]:
        n = x.shape[0]
        eye = torch.eye(n, dtype=x.dtype, device=x.device)
        params = []
        for layer in range(self.num_layers):
            w_ih, w_hh, *biases = self._layer_parameters(layer)
            params += [_block_diagonal(w_ih, self.GATES, eye), _block_diagonal(w_hh, self.GATES, eye)]
            # gate-major, as the weights' rows: [G, N, H] -> [G*N*H]
            params += [b.unflatten(1, (self.GATES, -1)).transpose(0, 1).flatten() for b in biases]
        # x [N, B, T, I] -> [B, T, N*I]; the state [N, layers, B, H] -> [layers, B, N*H]
        hidden = [_side_by_side(s) for s in self._state_tensors(state)]
        out, *final = self._native(_side_by_side(x), hidden, params)
        return _stacked(out, n), self._state(*(_stacked(f, n) for f in final))

    def _native(
        self, x: torch.Tensor, hidden: List[torch.Tensor], params: List[torch.Tensor]
    ) -> Tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _cell(
        self, projected: torch.Tensor, recurrent: torch.Tensor, carried: Tuple[torch.Tensor, ...]
    ) -> Tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _state(self, h: torch.Tensor, c: torch.Tensor) -> Any:
        raise NotImplementedError

    def _state_tensors(self, state: Any) -> Tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _layer_state(self, state: Any, layer: int) -> Tuple[torch.Tensor, ...]:
        return tuple(s[:, layer] for s in self._state_tensors(state))

    @classmethod
    def work(cls, n: int, batch: int, seq_len: int, hidden: int, **params: Any) -> Work:
        # two matmuls a step (input and recurrent, hidden x G*hidden each); weights and the
        # sequence read, the outputs written
        flops = 2.0 * 2 * n * batch * seq_len * hidden * cls.GATES * hidden
        elements = n * (2 * cls.GATES * hidden * hidden + 2 * batch * seq_len * hidden)
        return Work(flops, float(elements * itemsize(params)))

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return dict(hidden=module.hidden_size)

    @classmethod
    def bench_model(cls, hidden: int, **_: Any) -> nn.Module:
        return cls.FUSES(hidden, hidden, batch_first=True)

    @classmethod
    def bench_inputs(cls, n: int, batch: int, seq_len: int, hidden: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(batch, seq_len, hidden) for _ in range(n)]


def _side_by_side(t: torch.Tensor) -> torch.Tensor:
    """[N, A, B, K] -> [A, B, N*K]: the N models' features side by side, as one wide layer sees them."""
    return t.permute(1, 2, 0, 3).flatten(2)


def _stacked(t: torch.Tensor, n: int) -> torch.Tensor:
    """[A, B, N*K] -> [N, A, B, K]: the inverse of _side_by_side."""
    return t.unflatten(2, (n, -1)).permute(2, 0, 1, 3)


def _block_diagonal(weight: torch.Tensor, gates: int, eye: torch.Tensor) -> torch.Tensor:
    """[N, G*H, K] -> [G*N*H, N*K]: for each gate, the N models' blocks on the diagonal.

    Built by an einsum with the identity, so the gradient reaches the diagonal blocks only
    (the off-diagonal zeros are not parameters)."""
    n, rows, cols = weight.shape
    blocks = torch.einsum("nghk,nm->gnhmk", weight.unflatten(1, (gates, rows // gates)), eye)
    return blocks.reshape(rows * n, n * cols)


def _describe_rnn(m: nn.Module) -> dict:
    return dict(
        input_size=m.input_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        bias=m.bias,
        batch_first=m.batch_first,
        bidirectional=m.bidirectional,
        dropout=m.dropout,
        proj_size=getattr(m, "proj_size", 0),
    )


@register("gru")
class WideGRU(_WideRNN):
    """N nn.GRU. Strategies: 'fused_cell' (batched matmuls, the recurrence stepped once for
    all N), 'block_diagonal' (one GRU N times as wide, block-diagonal weights, torch's kernel)."""

    GATES = 3
    FUSES = nn.GRU

    def _cell(self, projected, recurrent, carried):
        # torch's gate order r, z, n; the reset gate scales the recurrent part of n, bias included
        ir, iz, i_n = projected.chunk(3, -1)
        hr, hz, h_n = recurrent.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        new = torch.tanh(i_n + r * h_n)
        return ((1 - z) * new + z * carried[0],)

    def _native(self, x, hidden, params):
        return torch.gru(x, hidden[0], params, self.bias, self.num_layers, 0.0, self.training, False, True)

    def _state(self, h, c=None):
        return h

    def _state_tensors(self, state):
        return (state,)


@register("lstm")
class WideLSTM(_WideRNN):
    """N nn.LSTM. Strategies: 'fused_cell', 'block_diagonal' (as WideGRU's)."""

    GATES = 4
    FUSES = nn.LSTM

    def _cell(self, projected, recurrent, carried):
        # torch's gate order i, f, g, o
        i, f, g, o = (projected + recurrent).chunk(4, -1)
        c = torch.sigmoid(f) * carried[1] + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    def _native(self, x, hidden, params):
        return torch.lstm(x, hidden, params, self.bias, self.num_layers, 0.0, self.training, False, True)

    def _state(self, h, c):
        return (h, c)

    def _state_tensors(self, state):
        return tuple(state)
