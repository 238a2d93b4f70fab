from __future__ import annotations

from fastapi import APIRouter, status

from app import repo
from app.api.deps import ProjectDep, SessionDep
from app.corpus import SampleIn, load_corpus, load_items, long_documents
from app.models import Suite
from app.repo import Conflict, NotFound
from app.schemas import SuiteIn, SuiteOut, error_responses
from app.services import check_project_room
from app.settings import get_settings

router = APIRouter(tags=["suites"], responses=error_responses(404))


def _out(suite: Suite) -> SuiteOut:
    settings = suite.settings
    return SuiteOut(id=suite.id, name=suite.name, n_documents=suite.n_documents, samples=settings.samples,
                    max_samples=settings.max_samples, top_up=settings.top_up, seed=settings.seed,
                    scorers=settings.scorers,
                    perplexity=settings.perplexity.model_dump(), generation=settings.generation.model_dump())


@router.post("/projects/{project}/suites", status_code=status.HTTP_201_CREATED, response_model=SuiteOut,
             responses=error_responses(400, 403, 409))
def create_suite(body: SuiteIn, project: ProjectDep, session: SessionDep) -> SuiteOut:
    settings = get_settings()
    try:
        repo.get_suite(session, project, body.name)
        raise Conflict(f"name: suite '{body.name}' already exists in project '{project.name}'; pick another name")
    except NotFound:
        pass
    check_project_room(session, project, "suites", [body.name], "name")
    if (body.corpus is None) == (body.documents is None):
        raise ValueError("corpus, documents: give exactly one — a server-side corpus or the documents inline")
    if body.documents is not None:
        if not body.documents:
            raise ValueError("documents: no documents given; send at least one {'id', 'text'}")
        if len(body.documents) > settings.max_suite_documents:
            raise ValueError(f"documents: {len(body.documents)} documents exceed the limit of "
                             f"{settings.max_suite_documents}")
        seen: set[str] = set()
        for i, document in enumerate(body.documents):
            if document.id in seen:
                raise ValueError(f"documents[{i}].id: duplicate id '{document.id}'; ids must be unique")
            if len(document.text) > settings.max_document_chars:
                raise ValueError(f"documents[{i}].text: {len(document.text)} characters exceed the limit of "
                                 f"{settings.max_document_chars}")
            extra = len(document.reference or "") + sum(len(context) for context in document.contexts or ())
            if extra > settings.max_document_chars:
                raise ValueError(f"documents[{i}].reference, contexts: {extra} characters together exceed the limit of "
                                 f"{settings.max_document_chars}")
            seen.add(document.id)
        samples = [SampleIn(document.id, document.text, reference=document.reference, contexts=document.contexts,
                            cluster=document.cluster or document.id) for document in body.documents]
    elif body.corpus is not None:  # exactly one of documents and corpus (checked above)
        if not body.corpus.startswith("builtin:"):  # API clients may not make the server read its own files
            raise ValueError(f"corpus: over the API the server reads builtin corpora only (builtin:pydoc-heldout), not "
                             f"'{body.corpus[:80]}'; send the documents inline in 'documents', or name the file in "
                             "canary.yaml and apply it with `canary run -f`")
        samples = load_corpus(body.corpus, "corpus", settings.max_suite_documents, settings.max_document_chars)
    samples, joined = long_documents(samples, body, settings.max_document_chars)
    if body.samples > len(samples):
        raise ValueError(f"samples: {body.samples} > {len(samples)} documents{joined}; lower samples or add "
                         "documents")
    if body.labelled.items:
        if not body.labelled.items.startswith("builtin:"):  # as for the corpus: no server file over the API
            raise ValueError(f"labelled.items: over the API the server reads built-in tasks only "
                             f"(builtin:pydoc-next-word), not '{body.labelled.items[:80]}'; name the file in "
                             "canary.yaml and apply it with `canary run -f`")
        samples = [*samples, *load_items(body.labelled.items)]
    spec = body.model_dump(exclude={"name", "documents"})
    return _out(repo.upsert_suite(session, project, body.name, spec, samples))


@router.get("/projects/{project}/suites", response_model=list[SuiteOut])
def list_suites(project: ProjectDep, session: SessionDep) -> list[SuiteOut]:
    return [_out(suite) for suite in repo.list_suites(session, project)]
