// Package dburl names the one PostgreSQL every program of this repository
// uses by default: the command, the demo, the example server and consumer,
// the load tool and the tests.
package dburl

import (
	"net/url"
	"os"
	"strings"
)

// EnvVar names the environment variable holding the database URL.
const EnvVar = "DATABASE_URL"

// Default is used when EnvVar is unset: the local PostgreSQL on its
// standard port, database "test", which scripts/services.sh starts.
const Default = "postgres://postgres:postgres@127.0.0.1:5432/test?sslmode=disable"

// URL returns $DATABASE_URL, else Default.
func URL() string {
	if u := os.Getenv(EnvVar); u != "" {
		return u
	}
	return Default
}

// Redacted returns raw with its password masked, for messages and flag
// help; a URL that does not parse is not shown at all.
func Redacted(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}

// Scrub masks the password of raw wherever it appears in s, such as in an
// error message that quotes a connection string.
func Scrub(s, raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		return s
	}
	if p, ok := u.User.Password(); ok && p != "" {
		s = strings.ReplaceAll(s, p, "xxxxx")
	}
	return s
}

// Usage is the help text of a program's database URL flag: where the URL
// comes from, and the one it will use, its password masked.
func Usage() string {
	s := "PostgreSQL URL (default: $" + EnvVar + ", else " + Redacted(Default) + ")"
	if u := os.Getenv(EnvVar); u != "" {
		s += "; $" + EnvVar + " is " + Redacted(u)
	}
	return s
}
