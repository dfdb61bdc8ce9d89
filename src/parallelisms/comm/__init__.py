"""Communication: the accounted collectives, the ledger, and the timeline."""

from parallelisms.comm.ledger import CommLedger, CommRecord, ring_bytes_per_rank
from parallelisms.comm.autograd import (all_to_all, copy_to_group, gather_along, reduce_from_group,
                                        reduce_scatter_along, split_along)
from parallelisms.comm.ops import Comm, CommError, Comms, Pending
from parallelisms.comm.trace import Timeline, write_chrome_trace

__all__ = ["Comm", "CommError", "CommLedger", "CommRecord", "Comms", "Pending", "Timeline", "all_to_all",
           "copy_to_group", "gather_along", "reduce_from_group", "reduce_scatter_along", "ring_bytes_per_rank",
           "split_along", "write_chrome_trace"]
