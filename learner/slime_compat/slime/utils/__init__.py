"""slime.utils: types, http_utils, misc and async_utils, as plugins import them."""
