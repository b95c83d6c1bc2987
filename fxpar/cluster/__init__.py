"""Cluster descriptions: the GPU catalog, cluster files, emulated CPU clusters and detection.

    >>> from fxpar.cluster import Cluster
    >>> Cluster.from_file("shared/scenarios/h100-a100-llama7b.yaml").world_size   # doctest: +SKIP
    32

Nothing here imports torch except ``Cluster.detect`` (in :mod:`fxpar.cluster.detect`).
"""

from fxpar.cluster.catalog import CATALOG, DeviceType, Dtype, lookup_device_type
from fxpar.cluster.cluster import Cluster, Device, DeviceGroup, NodeSpec

__all__ = [
    "CATALOG",
    "Cluster",
    "Device",
    "DeviceGroup",
    "DeviceType",
    "Dtype",
    "NodeSpec",
    "lookup_device_type",
]
