#!/usr/bin/python3
"""softverbs from a program that loads libibverbs with dlopen (issue 14).

Python loads pyverbs' extension modules, and with them libibverbs, with
dlopen after the program started: the provider preloaded by softverbs-run
must still register, and the completion-channel interposer must still be
the ibv_create_comp_channel pyverbs calls. Run under the launcher:

    softverbs-run /usr/bin/python3 crates/softverbs/tests/pyverbs_events.py

Two RC QPs of one context are connected to each other; the receive CQ has a
completion channel and is armed; a SEND must produce one event on the
channel (waited for at most 10 s, never for ever), then the receive
completion. Prints "pyverbs events ok" and exits 0, or raises.
"""
import signal
import sys

# Before pyverbs is imported libibverbs must not be in the process (else
# this would not test the dlopen path at all).
if "libibverbs.so" in open("/proc/self/maps").read():
    sys.exit("libibverbs already mapped before dlopen: not the case under test")

import pyverbs.device as d  # noqa: E402  (this dlopens libibverbs)
import pyverbs.enums as e  # noqa: E402
from pyverbs.addr import AHAttr  # noqa: E402
from pyverbs.cq import CQ, CompChannel  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: E402
from pyverbs.wr import SGE, RecvWR, SendWR  # noqa: E402

assert "libibverbs.so" in open("/proc/self/maps").read(), "pyverbs did not load libibverbs"

names = [x.name.decode() for x in d.get_device_list()]
print("devices:", names)
assert "softverbs0" in names, f"softverbs0 not among the devices {names}"

ctx = d.Context(name="softverbs0")
pd = PD(ctx)
ch = CompChannel(ctx)  # the interposer: a pipe, not a kernel command
scq = CQ(ctx, 16)
rcq = CQ(ctx, 16, None, ch, 0)
cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
qps = [QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=scq, rcq=rcq, cap=cap)) for _ in range(2)]
port = ctx.query_port(1)
for me, peer in ((0, 1), (1, 0)):
    a = QPAttr()
    a.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE
    a.path_mtu = e.IBV_MTU_1024
    a.dest_qp_num = qps[peer].qp_num
    a.rq_psn = 0
    a.sq_psn = 0
    a.max_rd_atomic = 1
    a.max_dest_rd_atomic = 1
    a.min_rnr_timer = 12
    a.timeout = 14
    a.retry_cnt = 7
    a.rnr_retry = 7
    a.ah_attr = AHAttr(port_num=1, dlid=port.lid)
    qps[me].to_rts(a)

size = 64
smr = MR(pd, size, e.IBV_ACCESS_LOCAL_WRITE)
rmr = MR(pd, size, e.IBV_ACCESS_LOCAL_WRITE)
smr.write(b"d" * size, size)
qps[1].post_recv(RecvWR(wr_id=7, num_sge=1, sg=[SGE(rmr.buf, size, rmr.lkey)]))

rcq.req_notify()
qps[0].post_send(SendWR(wr_id=9, opcode=e.IBV_WR_SEND, num_sge=1,
                        sg=[SGE(smr.buf, size, smr.lkey)]))
# pyverbs does not expose the channel's fd: a missing event must not hang,
# SIGALRM's default action ends the process (non-zero status) instead.
signal.alarm(10)
ch.get_cq_event(rcq)
signal.alarm(0)
rcq.ack_events(1)
n, wcs = rcq.poll(1)
assert n == 1 and wcs[0].wr_id == 7 and wcs[0].status == e.IBV_WC_SUCCESS, wcs
assert rmr.read(size, 0) == b"d" * size
n, wcs = scq.poll(1)
assert n == 1 and wcs[0].wr_id == 9 and wcs[0].status == e.IBV_WC_SUCCESS, wcs

for q in qps:
    q.close()
rcq.close()
scq.close()
ch.close()
smr.close()
rmr.close()
pd.close()
ctx.close()
print("pyverbs events ok")
