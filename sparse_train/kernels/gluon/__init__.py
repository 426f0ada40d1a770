"""Gluon kernels for Hopper (sm_90): the attention forward (``forward``) and the dQ / dK-dV backward
(``backward``) with TMA loads and warpgroup MMA; shared pieces in ``common``."""
