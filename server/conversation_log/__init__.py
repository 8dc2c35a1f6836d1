"""The write-behind conversation log (journal on disk, database behind it)."""

from server.conversation_log.log import ConversationLog, FsyncMode
from server.conversation_log.writer import JournalWriteError

__all__ = ["ConversationLog", "FsyncMode", "JournalWriteError"]
