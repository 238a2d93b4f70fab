"""The HTTP API (app/api/main.py). Installed plugins' scorers and metric rows load first
(vocabulary/plugins.py): the routes build the names they accept when they are imported."""

from vocabulary import plugins

plugins.load(plugins.VOCABULARY)
