//! A trainer's or an inference server's own command line: shell words ([`words`]), the launch
//! in a container's command ([`launcher`]), and its flags read and rewritten with the parser's
//! rules ([`flags`]): Hugging Face's for trainers, each engine's argparse for servers
//! ([`server`]). One reader, several rule sets.
//!
//! Pure: no I/O. The webhook reads a pod with it; the fuzz target `launch` feeds it anything.

pub mod config_file;
pub mod flags;
pub mod launcher;
pub mod server;
pub mod tune;
pub mod words;

pub use flags::{Edit, Flag, FlagRules, Flags, HfRules, MappedRules, SetError};
pub use launcher::{
    Arg, Argv, ArgvEdit, Field, Launch, LaunchError, Launcher, Place, Program, Search, find,
    find_both_in_env, find_by, find_by_in_env, find_in_env, runs_python,
};
pub use server::{ServerLaunch, ServerRules};
pub use words::{SplitError, Token, Word};
