"""docs/API.md against include/lwo.h where the guide has to list what the
header holds: the status table has one row per status, with its value; and the
guide's length (at most 1,000 lines)."""

import re

from conftest import HEADER, REPO


def test_the_status_table_lists_every_status_of_the_header():
    header = dict(re.findall(r"^\s*(LWO_(?:OK|END|ERR_\w+))\s*=\s*(\d+)", HEADER.read_text(),
                             re.M))
    assert len(header) > 30
    api = (REPO / "docs" / "API.md").read_text()
    rows = dict(re.findall(r"^\| `(LWO_(?:OK|END|ERR_\w+))` \| (\d+) \|", api, re.M))
    assert sorted(set(header) - set(rows)) == [], "statuses without a row"
    assert sorted(set(rows) - set(header)) == [], "rows of statuses lwo.h lacks"
    assert {k: v for k, v in rows.items() if header[k] != v} == {}, "values that differ"


def test_the_guide_stays_a_guide():
    # The reference is lwo.h; API.md names its declarations (docs_declarations checks
    # that it copies none) and stays short enough to read through.
    n = len((REPO / "docs" / "API.md").read_text().splitlines())
    assert n <= 1000, "docs/API.md has %d lines, more than 1,000: link lwo.h, " \
        "ARCHITECTURE.md or an example instead of restating them" % n
