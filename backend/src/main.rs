//! The `hugemem` command.

use anyhow::{Context, Result};
use backend::bench::clear::{self, ClearBenchConfig};
use backend::size::parse_size;
use clap::{Parser, Subcommand};
use guest_mem::PageSize;
use tracing_subscriber::EnvFilter;

/// hugemem: guest RAM on 1 GiB pages, cleared in parallel on NUMA-local workers.
#[derive(Debug, Parser)]
#[command(name = "hugemem", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmarks; each reports ratios against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(Bench),
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Clearing kernels and the parallel runner against the kernel's fault-time clearing.
    Clear {
        /// Bytes to clear (K/M/G suffixes, powers of 1024).
        #[arg(long, default_value = "1G", value_parser = parse_size_arg)]
        size: u64,
        /// Repetitions per figure; the best is reported.
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Worker counts for the parallel runner, e.g. `1,2,4` (default: 1..=all CPUs).
        #[arg(long, value_delimiter = ',')]
        threads: Vec<usize>,
        /// Page size: 1G, 2M or 4K (default: 1G, then 2M, then 4K, said out loud).
        #[arg(long, value_parser = parse_page_size_arg)]
        page_size: Option<PageSize>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn parse_page_size_arg(s: &str) -> Result<PageSize, String> {
    PageSize::parse(s).ok_or_else(|| format!("invalid page size {s:?}: expected 1G, 2M or 4K"))
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("hugemem: error: {e}");
        for cause in e.chain().skip(1) {
            eprintln!("  caused by: {cause}");
        }
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Bench(Bench::Clear { size, reps, threads, page_size, json }) => {
            let cfg = ClearBenchConfig { size, reps, threads, page_size };
            let report = clear::run(&cfg, &mut |line| tracing::info!("{line}")).context("bench clear failed")?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.to_table());
            }
        }
    }
    Ok(())
}
