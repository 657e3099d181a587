package main

import (
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// pgx 5.12 reads a URL's user-info as libpq does, up to the first '@'
// before any '/', so a password may hold '#' and '?' unencoded. It failed
// when the redaction read the URL with net/url, which cuts the fragment
// and the query first: for a password that starts with '#' or '?' (or with
// digits and then one of them), the authority that is left parses as a
// host and an empty or numeric port, net/url finds no password, and the
// whole string, password included, is printed as it is: in the help a
// mistyped flag prints ($DATABASE_URL) and in every error. The
// redaction now reads a URL as pgx does.
func TestPasswordWithHashOrQuestionMarkIsNeverPrinted(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ dsn, password string }{
		{"postgres://app:#s3cret@127.0.0.1:1/payments?connect_timeout=1", "#s3cret"},
		{"postgres://app:?s3cret@127.0.0.1:1/payments", "?s3cret"},
		{"postgres://app:12#s3cret@127.0.0.1:1/payments", "12#s3cret"},
		{"postgresql://app:#s3cret@127.0.0.1:1/payments", "#s3cret"},
	} {
		cfg, err := pgconn.ParseConfig(c.dsn)
		require.NoError(t, err, c.dsn)
		require.Equal(t, c.password, cfg.Password, "pgx reads %s's password", c.dsn)
		for _, args := range [][]string{
			{"-databse-url", "x", "migrate"}, // a mistyped flag prints the help, with $DATABASE_URL
			{"migrate"},
			{"-database-url", c.dsn, "inspect", "s", "k"},
		} {
			out, errOut, _ := command(t, []string{"DATABASE_URL=" + c.dsn}, "", args...)
			require.NotContains(t, out+errOut, "s3cret", "%s %v", c.dsn, args)
		}
	}
}

// A URL that pgx reads (a password with '?' past its first character, two
// IPv6 hosts) is refused by the command as not parsing, where pgx would
// connect: the check before pgx was stricter than pgx. It reads a URL as
// pgx does now.
func TestCommandAcceptsAQuestionMarkPasswordAndTwoIPv6Hosts(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"postgres://app:s3c?ret@127.0.0.1:1/payments?connect_timeout=1",
		"postgres://app:pw@[::1]:1,[::1]:2/payments?connect_timeout=1",
	} {
		_, err := pgconn.ParseConfig(dsn)
		require.NoError(t, err, "pgx reads %s", dsn)
		_, errOut, _ := command(t, nil, "", "-database-url", dsn, "migrate")
		require.NotContains(t, errOut, "does not parse", dsn)
		require.NotContains(t, errOut, "s3c", dsn)
	}
}

// No output ever shows a secret of the connection string, in any of the
// forms pgx reads: not the help a mistyped flag prints, with the string
// in $DATABASE_URL, nor an error that names it.
func TestPasswordIsNeverPrinted(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"postgres://app:pw-s3cret@127.0.0.1:1/payments?connect_timeout=1",
		"postgres://app:p%40ss-s3cret@127.0.0.1:1/payments?connect_timeout=1",
		"postgres://app@127.0.0.1:1/payments?connect_timeout=1&password=pw-s3cret&sslpassword=key-s3cret",
		"postgres://app@127.0.0.1:1/payments?connect_timeout=1&passfile=/home/app/pgpass-s3cret",
		"host=127.0.0.1 port=1 user=app password=pw-s3cret dbname=payments connect_timeout=1",
		"host=127.0.0.1 port=1 user=app password='two words s3cret' sslpassword='key s3cret' connect_timeout=1",
		"host=127.0.0.1 port=1 user=app password=esc\\ aped-s3cret connect_timeout=1",
		"postgres://app:pa/ss-s3cret@127.0.0.1:1/payments",            // does not parse
		"host=127.0.0.1 password='unterminated s3cret",                // does not parse
		"postgres://app:pw-s3cret@127.0.0.1:1/payments?sslmode=bogus", // pgx refuses it
	} {
		for _, args := range [][]string{
			{"-databse-url", "x", "migrate"}, // a mistyped flag prints the help
			{"-h"},
			{"migrate"},
			{"inspect", "s", "k"},
			{"list"},
			{"-database-url", dsn, "cleanup"},
		} {
			out, errOut, _ := command(t, []string{"DATABASE_URL=" + dsn}, "", args...)
			require.NotContains(t, out+errOut, "s3cret", "%s %v", dsn, args)
		}
	}
	_, errOut, code := command(t, []string{"DATABASE_URL=host=127.0.0.1 port=1 password='two words s3cret' connect_timeout=1"}, "", "-databse-url")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "$DATABASE_URL is host=127.0.0.1 port=1 password=xxxxx connect_timeout=1", "the rest is shown")
	_, errOut, code = command(t, []string{"DATABASE_URL=postgres://app:pa/ss-s3cret@127.0.0.1:1/payments"}, "", "migrate")
	require.Equal(t, 1, code)
	require.Contains(t, errOut, "percent-encode the special characters of its user name and password")
	_, _, code = command(t, nil, "", "nonsense")
	require.Equal(t, 2, code)
	_, _, code = command(t, nil, "", "inspect", "only-one")
	require.Equal(t, 2, code)
}
