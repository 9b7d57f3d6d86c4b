"""Communication: transports, halo exchange, reductions and layout changes, each with its adjoint."""

from hybridpar.comm.halo import DimExchange, HaloExchanger, halo_exchange
from hybridpar.comm.redistribute import gather, infer_global_shape, local_box, redistribute, scatter
from hybridpar.comm.reduce import no_grad_sync, reduce_gradients, sum_to_replicated, sync_grads
from hybridpar.comm.transport import MPIP2P, StagedP2P, TorchP2P, get_transport

__all__ = [
    "DimExchange", "HaloExchanger", "halo_exchange", "gather", "infer_global_shape", "local_box",
    "redistribute", "scatter", "no_grad_sync", "reduce_gradients", "sum_to_replicated", "sync_grads",
    "MPIP2P", "TorchP2P", "StagedP2P", "get_transport",
]
