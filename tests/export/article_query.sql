-- find slow ncclAllReduce calls and any TCP retransmits inside their window
WITH slow_collectives AS (
SELECT timestamp_ns, duration_ns, rank, nranks, comm_id_hash, pid
FROM nccl_events
WHERE op = 'ALL_REDUCE'
AND duration_ns > 50000000 -- > 50ms
)
SELECT s.rank, s.duration_ns/1e6 AS ms,
COUNT(t.timestamp_ns) AS retransmits_in_window
FROM slow_collectives s
LEFT JOIN tcp_events t
ON t.timestamp_ns BETWEEN s.timestamp_ns
AND s.timestamp_ns + s.duration_ns
AND t.event = 'tcp_retransmit_skb'
GROUP BY s.rank, s.duration_ns, s.timestamp_ns
ORDER BY ms DESC
LIMIT 20;
