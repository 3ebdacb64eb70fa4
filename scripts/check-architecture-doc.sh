#!/usr/bin/env bash
# Checks that docs/architecture.md names only things that exist in the tree:
# - every path it names (in backticks, or bare when it starts with crates/, docs/, scripts/,
#   tests/, contrib/ or fuzz/): a file or directory, taken as written from the repository's
#   root, else under crates/, crates/*/ or crates/*/src/ (the document names a crate's files
#   from its crate or its src/, e.g. `luks/driver.rs`, `ucrypt/src/volume.rs`);
# - every CamelCase type it names in backticks (`Volume`, `engine::crew::Crew`,
#   `Opened::Plain(Volume)`: for a path, its first CamelCase segment): a `struct`, `enum`,
#   `trait`, `type` or `union` of that name in crates/ (or one of the std types in STD_TYPES).
# Prints each name that does not exist and exits 1 if there is one. CI runs it (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
doc=${1:-docs/architecture.md}

# path<TAB>NAME and type<TAB>NAME lines, from the document without its fenced code blocks
# (the crate diagram).
names=$(perl -0777 -ne '
    s/^```.*?^```[^\n]*\n//msg;
    my %seen;
    my $emit = sub { my ($k, $v) = @_; print "$k\t$v\n" unless $seen{"$k\t$v"}++ };
    my $pathish = qr{^(?:(?:crates|docs|scripts|tests|contrib|fuzz)/[\w./-]*|[\w./-]+\.rs|[a-z_][a-z0-9_/]*/)$};
    while (/`([^`]+)`/g) {
        my $span = $1;
        for my $tok ($span =~ m{([\w.@/-]+)}g) {
            next if $tok =~ m{^/} or $tok =~ m{//};
            $tok =~ s/[.]+$//;
            $emit->("path", $tok) if $tok =~ $pathish;
        }
        while ($span =~ m{(?<![\w./@-])([A-Za-z_]\w*(?:::\w+)*)(?![\w./@-])}g) {
            my ($first) = grep { /^[A-Z]\w*[a-z]\w*$/ } split /::/, $1;
            $emit->("type", $first) if defined $first;
        }
    }
    my $text = $_;
    $text =~ s/`[^`]*`//g;
    while ($text =~ m{(?<![\w./-])((?:crates|docs|scripts|tests|contrib|fuzz)/[\w./-]*)}g) {
        (my $p = $1) =~ s/[.,;:)]+$//;
        $emit->("path", $p);
    }
' "$doc")

# Types from std the document may name in code (`Volume::new(Arc::new(nbd), cfg)`).
STD_TYPES="Arc Box Vec Option String Mutex Duration Instant Path PathBuf File"

defined=$(printf '%s\n' $STD_TYPES; grep -rhoE '\b(struct|enum|trait|type|union)[[:space:]]+[A-Z][A-Za-z0-9_]*' crates --include='*.rs' |
    awk '{print $2}')
defined=$(sort -u <<<"$defined")

path_exists() {
    local p=$1 c
    [ -e "$p" ] && return 0
    for c in crates/"$p" crates/*/"$p" crates/*/src/"$p"; do
        [ -e "$c" ] && return 0
    done
    return 1
}

missing=0 paths=0 types=0
while IFS=$'\t' read -r kind name; do
    [ -n "$kind" ] || continue
    case $kind in
    path)
        paths=$((paths + 1))
        if ! path_exists "$name"; then
            echo "$doc: no such file or directory: $name"
            missing=$((missing + 1))
        fi
        ;;
    type)
        types=$((types + 1))
        if ! grep -qxF "$name" <<<"$defined"; then
            echo "$doc: no struct, enum, trait or type named $name in crates/"
            missing=$((missing + 1))
        fi
        ;;
    esac
done <<<"$names"

if [ "$missing" -gt 0 ]; then
    echo "$doc: $missing of $((paths + types)) names do not exist" >&2
    exit 1
fi
echo "$doc: all $paths paths and $types types exist"
