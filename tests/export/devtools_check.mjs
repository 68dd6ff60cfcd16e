// Load a Chrome trace (JSON or .json.gz) with the Chrome DevTools trace engine
// (npm @paulirish/trace_engine: the Performance panel's model) and print, as JSON, what
// the engine built: slices per thread track, flows, counters it kept, process names.
// Usage: node devtools_check.mjs TRACE ENGINE_DIR
import fs from 'node:fs';
import zlib from 'node:zlib';

const [trace, engineDir] = process.argv.slice(2);
const Trace = await import(engineDir + '/models/trace/trace.js');
let buf = fs.readFileSync(trace);
if (buf[0] === 0x1f && buf[1] === 0x8b) buf = zlib.gunzipSync(buf);
const json = JSON.parse(buf.toString('utf8'));
const model = Trace.TraceModel.Model.createWithAllHandlers();
await model.parse(json.traceEvents, {metadata: {}, isFreshRecording: false});
const parsed = model.parsedTrace();
const d = parsed.data;
const threads = [];
let slices = 0, roots = 0, maxDepth = 0;
for (const [pid, p] of d.Renderer.processes) {
  for (const [tid, t] of p.threads) {
    slices += t.entries.length;
    roots += t.tree ? t.tree.roots.size : 0;
    threads.push({pid, tid, name: t.name ?? null, slices: t.entries.length});
  }
}
for (const node of d.Renderer.entryToNode.values()) maxDepth = Math.max(maxDepth, node.depth);
const counters = parsed.traceEvents.filter(e => e.ph === 'C').length;
const instants = parsed.traceEvents.filter(e => e.ph === 'i' || e.ph === 'I').length;
console.log(JSON.stringify({
  engine: JSON.parse(fs.readFileSync(engineDir + '/package.json', 'utf8')).version,
  slices, roots, maxDepth, threads,
  flows: d.Flows.flows.length,
  flowSizes: [...new Set(d.Flows.flows.map(f => f.length))],
  counters, instants,
  processNames: Object.fromEntries([...d.Meta.processNames].map(([pid, e]) => [pid, e.args.name])),
  genericTrace: d.Meta.traceIsGeneric,
}));
