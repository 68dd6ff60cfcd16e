"""The forked worker processes that write the per-node sections, and the parent's
side of their pipes."""

from __future__ import annotations

import os
import signal

import apsw

from .fleet import connect_fleet
from .options import AccelUnsupported, ExportError
from .output import PartFile, Spill


# ---------------------------------------------------------------------- workers

def worker_main(exporter, node_ids, tmpdir, gzip_level, conn) -> None:
    """A forked worker: its nodes' sections, section by section (every node's NCCL, then
    every node's CUDA, ...), each into its own part file, announced as soon as it is
    written so that the parent copies it while the rest is being written:
    ("part", node_id, section, Part, events, tracks after NCCL or None), then
    ("done", [NodeResult]); ("error", message or AccelUnsupported) on failure."""
    # Ctrl-C goes to the whole process group: the parent alone handles it (it terminates
    # the workers and removes the part files). SIGINT was blocked across the fork.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    path = None
    try:
        con = connect_fleet(exporter.path)   # never the parent's connection across fork
        try:
            # A fresh Tracks per node: a node's synthetic tids then depend only on its
            # own rows, never on which worker ran it or what it ran before.
            subs = [exporter._node_exporter(nid, con) for nid in node_ids]
            for name in exporter.node_sections():
                for sub in subs:
                    path = os.path.join(tmpdir, f"node-{sub.only_node}.{name}.part")
                    with PartFile(path, gzip_level, exporter.opts.max_events) as pf:
                        part = pf.section(getattr(sub, name))
                    # the flows need every node's NCCL tracks (and nothing later)
                    tracks = sub._result() if name == "nccl" else None
                    conn.send(("part", sub.only_node, name, part, pf.sink.events, tracks))
            out = [sub._result() for sub in subs]
        finally:
            Spill.close(exporter._spill_file)
            con.close()
        conn.send(("done", out))
    except AccelUnsupported as e:
        conn.send(("error", e))
    except apsw.Error as e:
        conn.send(("error", f"{exporter.path}: cannot read fleet.db ({e})"))
    except OSError as e:
        conn.send(("error", f"{path}: cannot write: {e.strerror or e}"))
    except ExportError as e:
        conn.send(("error", str(e)))
    except BaseException as e:  # a bug: still one line, naming the worker's node
        conn.send(("error", f"{exporter.path}: export worker failed: {type(e).__name__}: {e}"))


def analysis_main(exporter, conn) -> None:
    """A forked process running the findings analysis: ("analysis", Analysis) back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        exporter.run_analysis()
        conn.send(("analysis", exporter.analysis))
    except ExportError as e:
        conn.send(("error", str(e)))
    except BaseException as e:  # a bug: still one line
        conn.send(("error", f"{exporter.path}: findings analysis failed: "
                            f"{type(e).__name__}: {e}"))


class Workers:
    """Per-node sections in ``jobs`` forked processes (node i to worker i % jobs), and,
    with ``analysis``, the findings analysis in one more (it is a third of the CPU time of
    a large export and only needed at the end); their messages in arrival order. On any
    error or Ctrl-C in the parent, close() terminates every one."""

    def __init__(self, exporter, node_ids, tmpdir, gzip_level, jobs, analysis=False):
        import multiprocessing
        ctx = multiprocessing.get_context("fork")
        self.names = {n.node_id: n.name for n in exporter.nodes_all}
        self.path = exporter.path
        self.procs = []
        self.waiting = {}
        # Ctrl-C held back while forking: a worker must not die of it before it ignores
        # it, nor be started without being in procs (and so never terminated).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            tasks = [(worker_main, node_ids[w::jobs]) for w in range(jobs)]
            if analysis:
                tasks.append((analysis_main, None))
            for target, mine in tasks:
                recv, send = ctx.Pipe(duplex=False)
                args = ((exporter, mine, tmpdir, gzip_level, send) if mine is not None
                        else (exporter, send))
                proc = ctx.Process(target=target, args=args, daemon=True)
                self.procs.append((proc, recv))
                self.waiting[recv] = (proc, mine)
                proc.start()
                send.close()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def receive(self) -> list:
        """The next messages ("part", ...) and ("done", ...); [] once all are done."""
        from multiprocessing.connection import wait
        if not self.waiting:
            return []
        out = []
        for recv in wait(list(self.waiting)):
            proc, mine = self.waiting[recv]
            try:
                msg = recv.recv()
            except EOFError:
                proc.join()
                code = proc.exitcode
                why = f"killed by signal {-code}" if code and code < 0 else f"exit {code}"
                what = ("the findings analysis" if mine is None else "the export worker for "
                        + ", ".join(self.names[n] for n in mine))
                raise ExportError(f"{self.path}: {what} died ({why})") from None
            if msg[0] == "error":
                if isinstance(msg[1], AccelUnsupported):
                    raise msg[1]
                raise ExportError(msg[1])
            if msg[0] in ("done", "analysis"):
                del self.waiting[recv]
            out.append(msg)
        return out

    def close(self) -> None:
        for proc, recv in self.procs:
            if proc.pid is not None:       # started
                if proc.is_alive():
                    proc.terminate()
                proc.join()
            recv.close()
