//! A trainer's own command line: shell words ([`words`]), the launch in a container's command
//! ([`launcher`]), and its flags read and rewritten with the parser's rules ([`flags`]).
//!
//! Pure: no I/O. The webhook reads a pod with it; the fuzz target `launch` feeds it anything.

pub mod config_file;
pub mod flags;
pub mod launcher;
pub mod words;

pub use flags::{Edit, Flag, FlagRules, Flags, HfRules, SetError};
pub use launcher::{Arg, Launch, LaunchError, Launcher, Place, Program, find};
pub use words::{SplitError, Token, Word};
