"""docs/bundle-format.md stays in step with the code."""

import re
import sqlite3
from pathlib import Path

from ingero_forensics.bundle import schema, spec
from ingero_forensics.bundle.container import MANIFEST_FIELDS

DOC = Path(__file__).resolve().parents[2] / "docs" / "bundle-format.md"


def extract_ddl(text: str) -> str:
    blocks = re.findall(r"```sql\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "the spec must hold exactly one sql block (the DDL)"
    return blocks[0]


def test_generated_section_is_current():
    """If this fails, run: python -m ingero_forensics.bundle.spec docs/bundle-format.md"""
    text = DOC.read_text(encoding="utf-8")
    assert spec.splice(text) == text
    assert spec.main(["--check", str(DOC)]) == 0


def test_check_reports_a_stale_section(tmp_path, capsys):
    stale = tmp_path / "f.md"
    stale.write_text(f"intro\n{spec.BEGIN}\nold\n{spec.END}\nrest\n")
    assert spec.main(["--check", str(stale)]) == 1
    assert capsys.readouterr().err == f"{stale}: generated section is stale\n"
    assert spec.main([str(stale)]) == 0
    assert capsys.readouterr().err == f"{stale}: generated section updated\n"
    assert spec.main(["--check", str(stale)]) == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{spec.END}\nrest\n")
    no_markers = tmp_path / "g.md"
    no_markers.write_text("nothing")
    assert spec.main([str(no_markers)]) == 1
    assert capsys.readouterr().err == f"Error: {no_markers}: generated-section markers not found\n"


def test_ddl_in_the_doc_builds_the_catalogued_schema(tmp_path):
    con = sqlite3.connect(tmp_path / "d.db")
    con.executescript(extract_ddl(DOC.read_text(encoding="utf-8")))
    assert con.execute("PRAGMA application_id").fetchone()[0] == schema.APPLICATION_ID
    assert con.execute("PRAGMA user_version").fetchone()[0] == schema.FORMAT_VERSION
    for t in schema.TABLES:
        cols = [(r[1], r[2], bool(r[3])) for r in con.execute(f"PRAGMA table_info({t.name})")]
        # the first column is the primary key (table_info reports it as nullable)
        want = [(c.name, c.type, not c.nullable and c is not t.columns[0]) for c in t.columns]
        assert cols == want, t.name
    names = {r[0] for r in con.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    assert names == {t.name for t in schema.TABLES}


def test_every_catalogue_entry_is_in_the_doc():
    text = DOC.read_text(encoding="utf-8")
    for t in schema.TABLES:
        assert f"### `{t.name}`" in text
        for c in t.columns:
            assert f"| `{c.name}` |" in text
    for name, *_ in MANIFEST_FIELDS:
        assert f"| `{name}` |" in text
    for name, *_ in schema.HOST_METRICS + schema.STACK_FRAME_KEYS + schema.META_FIELDS:
        assert f"| `{name}` |" in text
    for op in schema.NCCL_OPS:
        assert f"`{op}`" in text


def test_enumerated_values_and_units_are_rendered():
    text = spec.render_table(schema.TABLES_BY_NAME["tcp_events"])
    assert "Values: `tcp_retransmit_skb`, `tcp_probe`." in text
    assert "| `srtt_us` | INTEGER | yes | us |" in text
    assert "| `id` | INTEGER PRIMARY KEY | no | - |" in text
