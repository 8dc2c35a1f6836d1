"""The write-behind conversation log (journal on disk, database behind it)."""

from server.conversation_log.log import ConversationLog, FsyncMode

__all__ = ["ConversationLog", "FsyncMode"]
