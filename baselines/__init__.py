"""Baseline methods, registered through the same hook as third-party methods."""

from p4bench.baselines.centralized import Centralized
from p4bench.baselines.dp_cga import DPCGA
from p4bench.baselines.dsgt import DPDSGD, DPDSGT
from p4bench.baselines.fedavg import FedAvg
from p4bench.baselines.feddf import FedDF
from p4bench.baselines.local import LocalTraining
from p4bench.baselines.muffliato import Muffliato
from p4bench.baselines.p2p_fl import P2PFL
from p4bench.baselines.pdsl import PDSL, PDSLLocalVal
from p4bench.baselines.proxyfl import ProxyFL
from p4bench.baselines.scaffold import Scaffold
from p4bench.hookspecs import hookimpl


@hookimpl
def register_methods():
    return [LocalTraining, Centralized, FedAvg, FedDF, Scaffold, ProxyFL, DPDSGT, DPDSGD, P2PFL, Muffliato, PDSL, PDSLLocalVal, DPCGA]
