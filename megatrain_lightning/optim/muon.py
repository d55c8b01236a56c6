"""``MuonWithAdamW``: torch's Muon for the 2-D hidden weights and torch's AdamW for the rest, as one optimizer.

``torch.optim.Muon`` takes only 2-D parameters, and its documentation pairs it with AdamW for the rest;
``MegaTrainStrategy`` steps exactly one optimizer, so this class is the pair as one per-parameter optimizer, run slab
by slab by :mod:`megatrain_lightning.optim.host_generic`. State: Muon's ``momentum_buffer`` (4 B/param), AdamW's
``exp_avg``, ``exp_avg_sq`` (8 B/param) and ``step``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (``torch.optim.Muon``) for groups with ``use_muon=True``, AdamW (``torch.optim.AdamW``) for groups with
    ``use_muon=False``; ``use_muon=None`` (the default): Muon for the group's 2-D parameters, AdamW for the others.

    Args:
        params: parameters or param groups (a group may set any keyword below, and ``use_muon``).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: ``torch.optim.Muon``'s,
            for the Muon groups.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: ``torch.optim.AdamW``'s ``lr``, ``betas``, ``eps``,
            ``weight_decay`` (see :meth:`add_param_group`).

    Raises:
        ValueError: a Muon group with a parameter that is not 2-D, or a bad value (``torch.optim``'s checks).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, adamw_lr: float = 1e-4,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.0, use_muon: bool | None = None) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
                        adamw_weight_decay=adamw_weight_decay, use_muon=use_muon)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, but a group with ``use_muon=False`` takes ``adamw_lr``/``adamw_weight_decay`` as its ``lr`` /
        ``weight_decay`` unless it sets them."""
        if param_group.get("use_muon", self.defaults.get("use_muon")) is False:
            param_group.setdefault("lr", param_group.get("adamw_lr", self.defaults["adamw_lr"]))
            param_group.setdefault("weight_decay", param_group.get("adamw_weight_decay",
                                                                   self.defaults["adamw_weight_decay"]))
        super().add_param_group(param_group)
        for p in param_group["params"] if param_group.get("use_muon") is True else ():
            if p.ndim != 2:
                raise ValueError(f"MuonWithAdamW: a use_muon=True group holds a parameter of shape {tuple(p.shape)}; "
                                 "Muon updates 2-D weights only (put the others in a use_muon=False group)")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient: torch's Muon / AdamW ``step`` per group (class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            muon = [p for p in ps if (p.ndim == 2 if g["use_muon"] is None else g["use_muon"])]
            ids = {id(p) for p in muon}
            rest = [p for p in ps if id(p) not in ids]
            if muon:
                inner: torch.optim.Optimizer = torch.optim.Muon(muon, **{k: g[k] for k in _MUON_KEYS})
                inner.state = self.state  # type: ignore[assignment]  # the state lives in this optimizer
                inner.step()
            if rest:
                inner = torch.optim.AdamW(rest, lr=g["lr"] if g["use_muon"] is False else g["adamw_lr"],
                                          betas=g["adamw_betas"], eps=g["adamw_eps"],
                                          weight_decay=g["weight_decay"] if g["use_muon"] is False
                                          else g["adamw_weight_decay"])
                inner.state = self.state  # type: ignore[assignment]
                inner.step()
        return loss
