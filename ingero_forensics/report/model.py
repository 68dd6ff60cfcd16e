"""What the analysis finds, as the report's forms read it: per node lateness, each
straggler with its windows, cause and evidence, and the Analysis that holds them all
(report/analyze.py fills it; render.py, text.py and --json show it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .evidence import Signal
from .lateness import Window

@dataclass
class NodeLateness:
    node_id: int
    name: str
    ranks: list[int]
    collectives: int
    median_ms: float
    p90_ms: float
    last_share: float   # share of the collectives in which this node arrived last
    late_bins: int
    cost_s: float = 0.0         # time the others waited for it beyond the jitter
    cost_share: float = 0.0     # cost_s over the run's duration


@dataclass
class Straggler:
    node: str
    node_id: int
    ranks: list[int]
    late_ranks: list[int]
    windows: list[Window]
    lateness_ms: float          # mean lateness in its windows
    peak_ms: float              # its typical lateness at the latest collective of a late bin
    late_bins: int
    cost_s: float
    cost_share: float
    relative_uncertainty_ms: float | None
    clock_caveat: bool          # lateness not well above the alignment uncertainty
    cause: str | None = None
    cause_confidence: str = "none"   # clear / weak / none
    #: weak: a second cause scoring at least half the first (the signals cannot tell
    #: the two apart: say so, rather than name one alone)
    close_cause: str | None = None
    evidence: list[str] = field(default_factory=list)
    signals: list[Signal] = field(default_factory=list)
    top_offenders: list[dict] = field(default_factory=list)
    #: what the next step needs beyond the rows (network: every peer and source address)
    evidence_facts: dict = field(default_factory=dict)
    next_step: str = ""
    #: what its lateness is measured against: "median" (the median arrival; the other
    #: node's with two nodes) or "early_half" (late together with other nodes: together.py)
    reference: str = "median"
    late_with: list[str] = field(default_factory=list)   # early_half: the others late with it
    jitter_ms: float | None = None    # early_half: the early half's own jitter
    #: no clear cause of its own, and one node's job connections retransmitted towards
    #: it often enough to make that node the network suspect: {node, retransmits}. A
    #: lossy link there would make this node its victim; its own slowness can cause them
    #: too, so the report names both readings instead of choosing
    retransmits_towards: dict | None = None
    #: other late nodes its own job connections retransmitted towards (not counted as its
    #: cause: a sender waits for a late receiver; it may be their victim)
    victim_of: list[str] = field(default_factory=list)


@dataclass
class Analysis:
    fleet: str
    nodes: int
    ranks: int
    collectives: int
    start_ns: int | None
    end_ns: int | None
    bin_ns: int
    noise_ms: float
    threshold_ms: float = 0.0
    #: where noise_ms comes from: "fleet" (the spread of every node's lateness) or
    #: "per_node" (each node's own variation: the nodes' steady offsets were larger)
    noise_basis: str = "fleet"
    #: two nodes, one later in nearly every bin but not beyond the jitter that its own
    #: lateness sets: {node, later_bins, bins, median_ms}; the verdict is "Cannot tell"
    pair_limited: dict | None = None
    #: the run has fewer time bins than a straggler must be late in, and a node late in
    #: them cost the others enough: {nodes, bins, min_bins, bin_s}; "Cannot tell"
    bins_limited: dict | None = None
    #: most collectives of the job's largest communicator lack ranks that no capture
    #: saw (coverage.py): {comm_id_hash, nranks, ranks_seen, collectives, short,
    #: missing}; "no straggler" cannot be said, and a named one comes with a caveat
    uncaptured: dict | None = None
    #: the network suspect, left unnamed where ranks went uncaptured and its
    #: retransmits towards captured nodes alone do not name it: {node, retransmits,
    #: unseen (those towards addresses no captured node owns), unseen_addresses, basis}
    network_unsure: dict | None = None
    #: "No straggler" where fewer than two links' transits were measured (no
    #: tcp_progress) and the transfer was worth a share of the run: rule 4c could not
    #: run, and the verdict says a slow link is not ruled out
    links_unmeasured: bool = False
    #: nodes late by no more than the clock alignment uncertainty between them and their
    #: peers (or an unbounded one): which node was late is not known, so none of them
    #: is named; [{node, ranks, peak_ms, lateness_ms, relative_uncertainty_ms}]
    clock_unsure: list[dict] = field(default_factory=list)
    straggler: str | None = None
    straggler_node_id: int | None = None
    straggler_ranks: list[int] = field(default_factory=list)
    late_ranks: list[int] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    cause: str | None = None
    cause_confidence: str | None = None   # clear / weak / none
    close_cause: str | None = None        # weak: the runner-up scoring half the cause or more
    clock_caveat: bool = False
    #: no straggler could be established because the nodes' clocks are only known to
    #: within more than the lateness worth reporting
    clock_limited: bool = False
    verdict: str = ""
    next_step: str = ""
    evidence: list[str] = field(default_factory=list)
    signals: list[Signal] = field(default_factory=list)
    stragglers: list[Straggler] = field(default_factory=list)
    #: late nodes put down to a lossy link elsewhere (no cause of their own), or to a
    #: straggler they were late with and resent towards (no clear cause of their own)
    victims: list[str] = field(default_factory=list)
    #: victims of the network suspect whose only clear cause was their waits for their
    #: own GPU work, in bins where the suspect retransmitted (a stalled collective's symptom)
    gpu_symptoms: list[str] = field(default_factory=list)
    #: the latter, each in a sentence (the verdict's; victims.demote_victims)
    victim_notes: list[str] = field(default_factory=list)
    lateness: list[NodeLateness] = field(default_factory=list)
    slow_bins: int = 0
    #: how the network suspect was found (report/network.py): "contrast" (its job
    #: connections retransmitted far more than the other nodes') or "slow_bins" (the
    #: most retransmits in the slow bins); None without one
    network_basis: str | None = None
    #: every link between two nodes of the job's TCP connections with its transit times
    #: (report/links.py): {from, to, transits, median_ms, p90_ms}; empty without
    #: tcp_progress 'arrive' rows
    links: list[dict] = field(default_factory=list)
    #: a link far slower than the others while nobody is late and nothing retransmits
    #: (rule 4c): {from, to, median_ms, p90_ms, transits, others_ms, score, side,
    #: clock_bound_ms, transfer_share, node, slow_links, and for a link slow in periods of
    #: the run only: windows [{start_ns, end_ns}], slow_bins, period_bins,
    #: period_transfer_ms, rest_transfer_ms, period_cost_share (empty, 0 or None where it
    #: was slow over the whole run; the other figures are then the periods')}; the named
    #: node (``straggler``) is its sender, or its receiver where every other link into
    #: that node is slow too
    link_suspect: dict | None = None
    #: such a link whose excess is not well above the alignment uncertainty between its
    #: two nodes: the same fields; not named, the verdict says that clocks cannot rule it out
    link_unsure: dict | None = None
    #: "No straggler", and one node waited for its own GPU work far longer than every
    #: other (SMALL_GPU_RATIO times their median) but under the score that names a GPU
    #: (rule 4b): {node, rank} and gpuwait.GPU_UNNAMED_FIELDS, said, not named;
    #: ``reading``: "gpu" (under the bar), "cpu" (its waiting threads' run-queue delay
    #: inside the waits was most of the excess) or "unsure" (GpuSuspect.reading), said
    #: at any score
    gpu_unnamed: dict | None = None
    #: a slow link (the link_suspect's fields and test) found beside a straggler or a
    #: lossy link already named, away from every node named or, slow all run, still the
    #: slow link outside the windows of the stragglers at its ends, each named with a
    #: clear cause of its own, not the network (``named_ends``, their names): a second,
    #: separate finding
    also_slow_link: dict | None = None
    #: a link slow in periods of the run only that is not named: the same fields and
    #: ``why``: "thin" (too few of its arrivals in them) or "costless" (the collectives'
    #: transfer in them cost under 1 % of the run)
    link_unnamed: dict | None = None
    #: a node whose ranks wait for their own GPU work far longer than every other node's
    #: while nobody arrives late (report/gpuwait.py): the GpuSuspect's fields; None without
    gpu_suspect: dict | None = None
    timeline: list[dict] = field(default_factory=list)   # per bin: t, suspect_ms, fleet_ms, transfer_ms
    cause_series: dict = field(default_factory=dict)     # metric over time, suspect vs others
    top_offenders: list[dict] = field(default_factory=list)
    evidence_facts: dict = field(default_factory=dict)
    slow_collectives: list[dict] = field(default_factory=list)
    alignment: list[dict] = field(default_factory=list)
    capture_issues: list[dict] = field(default_factory=list)
    capture_cost: dict = field(default_factory=dict)      # node -> % of one core
    #: node -> % of one CPU in the capture's BPF programs (where the kernel kept it)
    capture_bpf_cost: dict = field(default_factory=dict)
    inventory: dict = field(default_factory=dict)
    #: ranks that never entered a collective their communicator's peers entered (hangs.py)
    hangs: list[dict] = field(default_factory=list)
    #: communicators the merge inferred where the capture attached after their init
    #: (lateattach.py): streams, basis, and why a stream was matched with nothing
    inferred_communicators: list[dict] = field(default_factory=list)
    #: job ids of the traced processes (nodes.job_ids, processes.job_id)
    job_ids: list[str] = field(default_factory=list)
    #: first and last fleet time any node's capture saw (the title's span)
    capture_span: list = field(default_factory=list)
    #: the run every "% of the run" is a share of: the collectives' first to last entry,
    #: a pause longer than one bin counted as one bin (docs/report.md, rule 3), seconds
    run_s: float | None = None
    #: where the page's "seconds from the start of the data" count from: the same
    #: origin as ingero-export's --from/--to offsets (merge.nodes.data_start)
    data_start_ns: int | None = None
    #: the page's title (ingero-report --title, else the job, node count and time span,
    #: render.report_title: set by the command; empty here means not set yet)
    title: str = ""
    #: no node could be compared with another (one node, no NCCL): the verdict says
    #: what is missing, and ``host`` holds what the capture shows
    inconclusive: bool = False
    host: list[dict] = field(default_factory=list)
    #: next commands to look further, runnable as they are ({"what", "command"})
    commands: list[dict] = field(default_factory=list)
    #: figure -> the statements that computed it, runnable as they are ({"sql", "rows"})
    sql: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)
