"""One module per page; each exposes render(api, project, params)."""

from dashboard.views import alerts, compare, gates, overview, run_detail, trends

PAGES = {"Overview": overview.render, "Compare": compare.render, "Trends": trends.render, "Alerts": alerts.render,
         "Run detail": run_detail.render, "Gates": gates.render}
