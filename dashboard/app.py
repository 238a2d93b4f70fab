"""inference-canary dashboard: `streamlit run dashboard/app.py` (CANARY_API_URL, CANARY_API_KEY
= a read-only key; CANARY_DASHBOARD_WRITE_KEY only if people may create silences here)."""

from __future__ import annotations

import pathlib
import sys

import streamlit as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the repository root, for `dashboard.*`

from dashboard.client import Api, ApiError
from dashboard.views import PAGES

st.set_page_config(page_title="inference-canary", page_icon="🐤", layout="wide")
# Streamlit's red multiselect chips read as "critical" beside the verdict colours: a neutral grey-blue instead
st.markdown("<style>[data-testid='stMultiSelectTagsContainer'] span{background-color:#546e7a !important}</style>",
            unsafe_allow_html=True)
api = Api()
params = st.query_params
names = list(PAGES)
ALIASES = {n.lower().split()[0]: n for n in names}  # ?page=run (alert links), ?page=overview, …
asked = str(params.get("page", "Overview"))
asked = asked if asked in names else ALIASES.get(asked.lower().split(" ")[0], "Overview")
page = st.sidebar.radio("Page", names, index=names.index(asked))
try:
    projects = [p["name"] for p in api.get("/projects")]
except ApiError as e:
    st.error(str(e))
    st.stop()
if not projects:
    st.info("No projects yet. Create one with `canary run -f canary.yaml` or `POST /api/v1/projects`.")
    st.stop()
wanted = params.get("project")
project = st.sidebar.selectbox("Project", projects, index=projects.index(wanted) if wanted in projects else 0)
st.sidebar.caption(f"API {api.base_url}" + (" · read-only" if not api.can_write else " · write key set"))
try:
    PAGES[str(page)](api, project, params)  # the radio always has a page selected
except ApiError as e:
    st.error(str(e))
