//! memguard-webhook (to be built by the webhook work, issue 3).
