"""Averagers that speak one protocol answer to one set of RPC names.

hivemind names an averager's RPCs after its Python class (``<prefix>::<class name>.rpc_join_group``), so two
subclasses that differ only in how they keep their tensors cannot talk to each other: a GPU trainer whose gradients go
to host buffers (:class:`~lean_transformer.swarm.averaging.host_grad_averager.HostGradientAverager`) called
``HostGradientAverager.rpc_join_group`` on a CPU trainer that serves ``GradientAverager.rpc_join_group``, and the two
never averaged gradients together (nor with an aux peer assisting in averaging). Here a class names its RPCs with its
``rpc_class_name``, which subclasses inherit. Reproduced by ``tests/test_averagers.py``
(``test_averagers_of_one_protocol_share_their_rpc_names``) and ``tests/test_trainer_host_gradients.py`` (a host-gradient
trainer and a plain one average together). Drop when hivemind names RPCs by protocol rather than by class.
"""
from __future__ import annotations

from typing import ClassVar, Optional


class NamedRPCs:
    """Mixed in front of a hivemind averager: its RPCs are named ``<namespace>::<rpc_class_name>.<method>``."""

    rpc_class_name: ClassVar[str]

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        handle_name = f"{cls.rpc_class_name}.{method_name}"
        return f"{namespace}::{handle_name}" if namespace else handle_name
