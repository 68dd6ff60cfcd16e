"""Uprobes a library at a time (capture/ebpf/uprobes.py): uprobe_multi links where the
kernel has them, one perf event per probe otherwise or where a link is refused. Real
eBPF, the real ingero-capture, the shim libraries."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess

import pytest

from ingero_forensics.bundle.reader import open_bundle
from ingero_forensics.capture.ebpf.uprobes import dispatch_programs, kernel_has_links

from .test_capture_e2e import capture_cmd
from .test_stop import fds_of_kind, perf_event_fds


def test_dispatcher_has_one_case_per_call_and_a_program_per_symbol():
    text = dispatch_programs("api", {3: "f(ctx, 3)", 7: "g(ctx)"}, "launch_multi")
    assert "int api_3(struct pt_regs *ctx) { return f(ctx, 3); }" in text
    assert "int api_7(struct pt_regs *ctx) { return g(ctx); }" in text
    assert "int launch_multi(struct pt_regs *ctx)" in text
    assert "case 3: return f(ctx, 3);" in text and "case 7: return g(ctx);" in text


def test_kernel_has_links_reads_kallsyms(tmp_path):
    (tmp_path / "yes").write_text("ffffffff81000000 T _stext\n"
                                  "ffffffff812d4a10 T bpf_uprobe_multi_link_attach\n")
    (tmp_path / "no").write_text("ffffffff81000000 T _stext\nffffffff812d4a10 T bpf_link_new\n")
    kernel_has_links.cache_clear()
    try:
        assert kernel_has_links(str(tmp_path / "yes"))
        assert not kernel_has_links(str(tmp_path / "no"))
        assert not kernel_has_links(str(tmp_path / "absent"))
    finally:
        kernel_has_links.cache_clear()


def _capture(fixtures, out, env_extra=None):
    target = subprocess.Popen(["sleep", "300"])
    env = dict(os.environ, **(env_extra or {}))
    cap = subprocess.Popen(
        [*capture_cmd(), "--bundle", str(out), "--node", "uprobe-node", "--pid",
         str(target.pid), "--lib", str(fixtures.libnccl), "--lib", str(fixtures.libcudart),
         "--start-priority", "normal"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    for line in cap.stderr:
        if "sources on:" in line:
            break
    return target, cap


def _stop(target, cap) -> str:
    cap.send_signal(signal.SIGTERM)
    err = cap.stderr.read()
    try:
        assert cap.wait(timeout=120) == 0, err
    finally:
        target.kill()
        if cap.poll() is None:
            cap.kill()
    return err


def _attached(out) -> dict[str, str]:
    (bundle,) = out.glob("*.bundle")
    with open_bundle(bundle) as b:
        return dict(b.con.execute("SELECT source, message FROM capture_log WHERE event = "
                                  "'attached' AND source IN ('nccl', 'cuda')"))


def _warnings(out) -> list[str]:
    (bundle,) = out.glob("*.bundle")
    with open_bundle(bundle) as b:
        return [m for (m,) in b.con.execute("SELECT message FROM capture_log WHERE "
                                            "level = 'warning'")]


@pytest.mark.ebpf
def test_a_librarys_uprobes_are_a_few_links(ebpf_ok, fixtures, tmp_path):
    """By default (this kernel has uprobe_multi) the nccl and cuda sources' 70-odd uprobes
    are a handful of bpf links instead of a perf event each, and the capture says so."""
    if not kernel_has_links():
        pytest.skip("this kernel has no uprobe_multi links (Linux 6.6)")
    target, cap = _capture(fixtures, tmp_path / "perf", {"INGERO_UPROBES": "perf"})
    perf_fds = perf_event_fds(cap.pid)
    _stop(target, cap)
    target, cap = _capture(fixtures, tmp_path / "links")
    link_fds, linked_perf_fds = fds_of_kind(cap.pid, "anon_inode:bpf_link"), perf_event_fds(cap.pid)
    _stop(target, cap)
    # nccl: entries, returns, InitAll's return; cuda: calls, launches, returns, marks
    assert 5 <= link_fds <= 12, link_fds
    # the tracepoint sources keep their perf events; the 70-odd uprobes left them
    assert perf_fds - linked_perf_fds >= 40, (perf_fds, linked_perf_fds)
    attached = _attached(tmp_path / "links")
    assert set(attached) == {"nccl", "cuda"}, attached
    assert all(m.endswith("uprobe_multi links") for m in attached.values()), attached
    assert all("perf event" in m for m in _attached(tmp_path / "perf").values())


def _other_tracer_uprobe(bcc, fn_fd, path: bytes, sym: bytes, ref_ctr_offset: int,
                         ev_name: bytes) -> int:
    """A uprobe placed as another tracer would (libbcc's real 7-argument call); its fd,
    negative if the kernel refused it."""
    _, offset = bcc.BPF._check_path_symbol(path, sym, None, -1)
    attach = bcc.libbcc.lib.bpf_attach_uprobe   # the C signature: ref_ctr_offset last
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
                             ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_uint32)
    return proto(ctypes.cast(attach, ctypes.c_void_p).value)(
        fn_fd, 0, ev_name, path, offset, -1, ref_ctr_offset)


@pytest.mark.ebpf
def test_perf_event_uprobes_leave_the_function_to_other_tracers(ebpf_ok, fixtures, tmp_path):
    """A capture's perf-event uprobes carry no reference counter: BCC's own attach_uprobe
    (0.26) passes stack garbage as one (0x6 here), and the kernel then refuses any other
    tracer's uprobe on that function (bpftrace, perf probe: 'ref_ctr_offset mismatch').
    With the capture's probes on, another uprobe without a counter attaches."""
    from ingero_forensics.capture.ebpf._bcc import import_bcc
    bcc = import_bcc()
    other = bcc.BPF(text=b"int other(struct pt_regs *ctx) { return 0; }")
    fn = other.load_func(b"other", bcc.BPF.KPROBE)
    target, cap = _capture(fixtures, tmp_path / "b", {"INGERO_UPROBES": "perf"})
    fds = []
    try:
        for sym in (b"ncclAllReduce", b"ncclCommInitRank"):        # an entry, an entry+return
            fds.append(_other_tracer_uprobe(bcc, fn.fd, str(fixtures.libnccl).encode(), sym, 0,
                                            b"p_ingero_test_" + sym))
        fds.append(_other_tracer_uprobe(bcc, fn.fd, str(fixtures.libcudart).encode(),
                                        b"cudaLaunchKernel", 0, b"p_ingero_test_launch"))
    finally:
        for fd, ev in zip(fds, (b"ncclAllReduce", b"ncclCommInitRank", b"launch")):
            if fd >= 0:
                os.close(fd)
                bcc.libbcc.lib.bpf_detach_uprobe(b"p_ingero_test_" + ev)
        other.cleanup()
        _stop(target, cap)
    assert all(fd >= 0 for fd in fds), f"another tracer's uprobes refused: {fds}"
    attached = _attached(tmp_path / "b")
    assert all("one perf event per uprobe" in m for m in attached.values()), attached
    assert "not attached" not in attached["nccl"], attached


@pytest.mark.ebpf
def test_a_library_another_tracer_probes_falls_back_to_perf_events(ebpf_ok, fixtures, tmp_path):
    """Another tracer holds a uprobe on ncclAllReduce with a USDT-style reference counter
    (the kernel then refuses a link there: 'ref_ctr_offset mismatch'): that library's
    probes are attached one perf event each, with a warning that says why; the others
    stay links."""
    if not kernel_has_links():
        pytest.skip("this kernel has no uprobe_multi links (Linux 6.6)")
    from ingero_forensics.capture.ebpf._bcc import import_bcc
    bcc = import_bcc()
    other = bcc.BPF(text=b"int other(struct pt_regs *ctx) { return 0; }")
    fn = other.load_func(b"other", bcc.BPF.KPROBE)
    fd = _other_tracer_uprobe(bcc, fn.fd, str(fixtures.libnccl).encode(), b"ncclAllReduce", 2,
                              b"p_ingero_test_other")
    assert fd >= 0, "could not place the other tracer's uprobe"
    try:
        target, cap = _capture(fixtures, tmp_path / "b")
        _stop(target, cap)
    finally:
        os.close(fd)
        bcc.libbcc.lib.bpf_detach_uprobe(b"p_ingero_test_other")
        other.cleanup()
    attached = _attached(tmp_path / "b")
    # every other function of that libnccl is probed by a perf event; ncclAllReduce
    # itself is refused that way too (the reference counters differ), and said so
    assert f"uprobes on {fixtures.libnccl}: 17 functions (not attached: ncclAllReduce (the " \
        "kernel refused the uprobe" in attached["nccl"], attached
    assert attached["nccl"].endswith(f"one perf event per uprobe on {fixtures.libnccl}")
    warned = [w for w in _warnings(tmp_path / "b") if "ref_ctr_offset mismatch" in w]
    assert any(str(fixtures.libnccl) in w and "one perf event each" in w for w in warned), \
        _warnings(tmp_path / "b")
    # the cuda source's marks on the same libnccl fall back alike; libcudart stays links
    assert "marks on" in attached["cuda"] and "ncclAllReduce (the kernel refused" in attached["cuda"]
    assert "uprobe_multi links" in attached["cuda"], attached
    assert attached["cuda"].endswith(f"one perf event per uprobe on {fixtures.libnccl}"), attached
