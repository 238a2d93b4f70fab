"""Init container of the API, the workers and the beat: exit 0 once the database is at the
migrations' head (the canary-migrate Job has run), keep waiting while it is not or cannot be
reached, exit 1 after the deadline (seconds, first argument; default 900)."""

import sys
import time

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from app.db import alembic_config, get_engine

deadline = time.monotonic() + float(sys.argv[1] if len(sys.argv) > 1 else 900)
heads = set(ScriptDirectory.from_config(alembic_config()).get_heads())
while True:
    try:
        with get_engine().connect() as conn:
            current = set(MigrationContext.configure(conn).get_current_heads())
        if current == heads:
            print(f"database at the migrations' head {sorted(heads)}", flush=True)
            sys.exit(0)
        state = f"database at {sorted(current) or 'no revision'}, migrations at {sorted(heads)}"
    except Exception as e:  # noqa: BLE001 — unreachable or not yet created: wait
        state = f"database unreachable ({type(e).__name__})"
    if time.monotonic() > deadline:
        print(f"gave up waiting for the migration job: {state}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"waiting for the migration job (canary-migrate): {state}", flush=True)
    time.sleep(3)
