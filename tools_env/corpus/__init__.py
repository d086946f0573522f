"""A synthetic local search corpus: fictional entities whose facts are known only from its documents."""

from tools_env.corpus.generate import Document, World, build_world, load_corpus, write_corpus

__all__ = ["Document", "World", "build_world", "load_corpus", "write_corpus"]
