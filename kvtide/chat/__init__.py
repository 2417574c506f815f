"""`kvtide chat`: an interactive, streamed conversation with a model in the terminal."""

from kvtide.chat.session import ChatSession, TurnResult

__all__ = ["ChatSession", "TurnResult"]
