"""API request and response schemas (kept apart from the SQLAlchemy models)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.config_file import NAME_PATTERN, ConfigEntry, GenerationSettings, PerplexitySettings, SuiteEntry


class ProjectIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)


class ProjectOut(BaseModel):
    id: int
    name: str


class ModelIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    path: str = Field(min_length=1, max_length=4096)


class ModelOut(BaseModel):
    id: int
    name: str
    path: str


class ConfigIn(ConfigEntry):
    model: str = Field(description="name of a model in this project")


class ConfigOut(BaseModel):
    id: int
    name: str
    model: str
    baseline: bool
    spec: dict[str, Any]


class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=256)
    text: str = Field(min_length=1)
    reference: str | None = None
    contexts: list[str] | None = None
    cluster: str | None = Field(None, max_length=256)


class SuiteIn(SuiteEntry):
    corpus: str | None = Field(None, description="server-side corpus (builtin:pydoc-heldout); or send documents")
    documents: list[DocumentIn] | None = Field(None, description="the suite's documents inline")


class SuiteOut(BaseModel):
    id: int
    name: str
    n_documents: int
    samples: int
    seed: int
    scorers: list[str]
    perplexity: PerplexitySettings
    generation: GenerationSettings


class RunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    suite: str
    configs: list[str] | None = Field(None, description="config names; default all; the baseline is always included")
    samples: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    trigger: str = Field("manual", pattern="^(manual|schedule|gate|alert)$")


class SampleResultOut(BaseModel):
    config: str
    sample_key: str
    metric: str
    value: float | None
    extra: dict[str, Any] | None


class SamplePage(BaseModel):
    total: int
    offset: int
    limit: int
    items: list[SampleResultOut]
