package idempotency_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// JSON request bodies are compared by value: a retry whose JSON differs
// only in whitespace, key order or string escapes (protojson varies its
// spacing between builds on purpose) is replayed, never 422; any other
// body, and JSON that does not parse, is compared by its bytes.

// jsonServer serves POST /v1/charges behind the middleware with a handler
// that answers with its run's number and what it read.
func jsonServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	return jsonServerOn(t, suiteDB(t))
}

// jsonServerOn is jsonServer on db, whose rows a test reads or rewrites.
func jsonServerOn(t *testing.T, db *testdb.DB) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d charged %d bytes", n, len(b))
	})))
	t.Cleanup(srv.Close)
	return srv, &runs
}

// sendJSON posts body under contentType with key and reads the answer.
func sendJSON(t *testing.T, srv *httptest.Server, key, contentType, body string) mountedReply {
	t.Helper()
	return do(t, srv.Client(), mountedPost(t, srv.URL+"/v1/charges", contentType, body), key)
}

// It failed because a body was compared by its bytes alone: the retry of
// the same JSON written another way (the space protojson adds after a
// comma in one build and not in another, indentation, keys in another
// order, a trailing newline, "\u00e9" for "é") got 422, as if the key had
// been reused for another request.
func TestHTTPJSONRetryWrittenAnotherWayIsReplayed(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	msg, err := structpb.NewStruct(map[string]any{"account_id": "acct-7", "amount_cents": "100", "note": "café"})
	require.NoError(t, err)
	compact, err := protojson.Marshal(msg)
	require.NoError(t, err)
	multiline, err := protojson.MarshalOptions{Multiline: true}.Marshal(msg)
	require.NoError(t, err)
	require.NotEqual(t, string(compact), string(multiline))
	var indented bytes.Buffer
	require.NoError(t, json.Indent(&indented, compact, "", "\t"))

	first := sendJSON(t, srv, "k-json", "application/json", `{"account_id":"acct-7","amount_cents":"100","note":"café"}`)
	require.Equal(t, http.StatusCreated, first.status, first.body)
	for _, retry := range []struct{ name, body string }{
		{"a space after each comma", `{"account_id":"acct-7", "amount_cents":"100", "note":"café"}`},
		{"protojson, one line", string(compact)},
		{"protojson, multi-line", string(multiline)},
		{"indented with tabs, CRLF", strings.ReplaceAll(indented.String(), "\n", "\r\n")},
		{"keys in another order", `{"note":"café","amount_cents":"100","account_id":"acct-7"}`},
		{"a trailing newline", `{"account_id":"acct-7","amount_cents":"100","note":"café"}` + "\n"},
		{"a string escaped another way", `{"account_id":"acct\u002d7","amount_cents":"100","note":"caf\u00e9"}`},
	} {
		r := sendJSON(t, srv, "k-json", "application/json", retry.body)
		require.Equal(t, http.StatusCreated, r.status, "%s: %s", retry.name, r.body)
		require.Equal(t, first.body, r.body, retry.name)
		require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader), retry.name)
	}
	require.EqualValues(t, 1, runs.Load(), "one execution")

	// A +json media type (RFC 6839) is JSON too.
	first = sendJSON(t, srv, "k-json-suffix", "application/vnd.api+json", `{"data":{"type":"charges","id":"1"}}`)
	r := sendJSON(t, srv, "k-json-suffix", "application/vnd.api+json", `{ "data": { "id": "1", "type": "charges" } }`)
	require.Equal(t, first.body, r.body)
	require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 2, runs.Load())
}

// What the canonical form keeps apart: another value, and what a Go
// handler reads differently although RFC 8785 (JCS) would write it one
// way: 100 and 100.0 or 1e2 (json.Unmarshal into an int refuses the
// last two), two integers past 2^53 (one float64, two int64s), one key's
// members in another order (encoding/json keeps the last), a key spelled
// in another case.
func TestHTTPJSONOfAnotherValueIs422(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	for i, c := range []struct{ first, other string }{
		{`{"account_id":"acct-7","amount_cents":100}`, `{"account_id":"acct-7","amount_cents":101}`},
		{`{"account_id":"acct-7","amount_cents":100}`, `{"account_id":"acct-8","amount_cents":100}`},
		{`{"account_id":"acct-7","amount_cents":100}`, `{"account_id":"acct-7","amount_cents":100.0}`},
		{`{"account_id":"acct-7","amount_cents":100}`, `{"account_id":"acct-7","amount_cents":1e2}`},
		{`{"amount_cents":9007199254740993}`, `{"amount_cents":9007199254740992}`},
		{`{"amount_cents":1,"amount_cents":2}`, `{"amount_cents":2,"amount_cents":1}`},
		{`{"amount_cents":1}`, `{"Amount_cents":1}`},
		{`{"items":["a","b"]}`, `{"items":["b","a"]}`},
	} {
		key := fmt.Sprintf("k-other-%d", i)
		require.Equal(t, http.StatusCreated, sendJSON(t, srv, key, "application/json", c.first).status)
		r := sendJSON(t, srv, key, "application/json", c.other)
		require.Equal(t, http.StatusUnprocessableEntity, r.status, "%s after %s: %s", c.other, c.first, r.body)
		require.EqualValues(t, i+1, runs.Load(), "%s ran", c.other)
	}
}

// It would fail if any body were compared as JSON: under a media type that
// is not JSON (text/plain, none, newline-delimited JSON) a body is its
// bytes, JSON or not, so the same bytes are replayed and a reordered
// object is another request.
func TestHTTPJSONUnderAnotherMediaTypeIsComparedByBytes(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	for i, ct := range []string{"text/plain", "", "application/x-ndjson", "application/jsonl"} {
		key := fmt.Sprintf("k-bytes-%d", i)
		first := sendJSON(t, srv, key, ct, `{"a":1,"b":2}`)
		require.Equal(t, http.StatusCreated, first.status, first.body)
		same := sendJSON(t, srv, key, ct, `{"a":1,"b":2}`)
		require.Equal(t, "true", same.header.Get(idempotency.ReplayedHeader), "Content-Type %q: the same bytes", ct)
		for _, other := range []string{`{"b":2,"a":1}`, `{"a":1,"b":2}` + "\n", `{"a":1, "b":2}`} {
			r := sendJSON(t, srv, key, ct, other)
			require.Equal(t, http.StatusUnprocessableEntity, r.status, "Content-Type %q: %q after %q: %s", ct, other, `{"a":1,"b":2}`, r.body)
		}
		require.EqualValues(t, i+1, runs.Load())
	}
}

// A JSON body that does not parse is compared by its bytes: two that
// differ by a byte are never one request. Among them, bodies that
// encoding/json does read, as the same value, but that differ: strings
// that are not UTF-8, or hold half of a surrogate pair (both read as
// U+FFFD), so that a canonical form made by decoding would take them for
// one request.
func TestHTTPInvalidJSONIsComparedByBytes(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	for _, pair := range [][2]string{
		{"\"\xff\"", "\"\xfe\""},
		{`"\ud800"`, `"\udc00"`},
	} {
		var a, b string
		require.NoError(t, json.Unmarshal([]byte(pair[0]), &a))
		require.NoError(t, json.Unmarshal([]byte(pair[1]), &b))
		require.Equal(t, a, b, "sanity: encoding/json reads %q and %q as one string", pair[0], pair[1])
	}
	for i, c := range []struct{ first, other string }{
		{`{"a":1,}`, `{"a":1 ,}`},
		{`{"a":1`, `{"a": 1`},
		{`{"a":1}{"b":2}`, `{"a":1} {"b":2}`},
		{"\xef\xbb\xbf{\"a\":1}", "\xef\xbb\xbf{\"a\": 1}"}, // after a byte order mark
		{"{\"note\":\"\xff\"}", "{\"note\":\"\xfe\"}"},
		{`{"note":"\ud800"}`, `{"note":"\udc00"}`},
		{`{"note":"\ud800"}`, `{"note":"\ud800" }`},
	} {
		key := fmt.Sprintf("k-invalid-%d", i)
		first := sendJSON(t, srv, key, "application/json", c.first)
		require.Equal(t, http.StatusCreated, first.status, first.body)
		same := sendJSON(t, srv, key, "application/json", c.first)
		require.Equal(t, "true", same.header.Get(idempotency.ReplayedHeader), "%q: the same bytes are replayed", c.first)
		r := sendJSON(t, srv, key, "application/json", c.other)
		require.Equal(t, http.StatusUnprocessableEntity, r.status, "%q after %q: %s", c.other, c.first, r.body)
		require.EqualValues(t, i+1, runs.Load())
	}
}

// Nesting as deep as encoding/json reads (10,000 levels) and numbers of
// any size are compared by value, without a panic and without the number
// being rounded; nesting deeper than that is compared by its bytes.
func TestHTTPDeepAndHugeJSON(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	deepest := strings.Repeat(`{"a":[`, 4999) + `{"a":[]}` + strings.Repeat("]}", 4999)
	tooDeep := "[" + deepest + "]"
	require.True(t, json.Valid([]byte(deepest)))
	require.False(t, json.Valid([]byte(tooDeep)), "sanity: encoding/json refuses it")
	digits := strings.Repeat("9", 200_000)
	for i, c := range []struct {
		name, first, same, other string
	}{
		{"10,000 levels", deepest, strings.ReplaceAll(deepest, ":", ": "), strings.Replace(deepest, `"a"`, `"b"`, 1)},
		{"a 200,000-digit integer", `{"n":` + digits + `}`, `{ "n" : ` + digits + ` }`, `{"n":` + digits[1:] + `8}`},
		{"an exponent past float64", `{"n":1e999999999,"m":-1E-999999999}`, `{"m":-1E-999999999, "n":1e999999999}`, `{"n":1e999999998,"m":-1E-999999999}`},
		{"10,001 levels", tooDeep, tooDeep, "[" + strings.ReplaceAll(deepest, "[]", "[ ]") + "]"},
	} {
		key := fmt.Sprintf("k-deep-%d", i)
		first := sendJSON(t, srv, key, "application/json", c.first)
		require.Equal(t, http.StatusCreated, first.status, "%s: %s", c.name, first.body)
		same := sendJSON(t, srv, key, "application/json", c.same)
		require.Equal(t, first.body, same.body, c.name)
		require.Equal(t, "true", same.header.Get(idempotency.ReplayedHeader), c.name)
		other := sendJSON(t, srv, key, "application/json", c.other)
		require.Equal(t, http.StatusUnprocessableEntity, other.status, "%s: %s", c.name, other.body)
		require.EqualValues(t, i+1, runs.Load(), c.name)
	}
}

// version4Row is the fingerprint the release before this one (version 4,
// a JSON body digested by its bytes) stored for POST /v1/charges to host
// api.example with Content-Type application/json and the body
// {"amount_cents":100,"account_id":"acct-7"}: computed by that release's
// httpFingerprint.
const version4Row = "ff49444604ed4c5e8ba19b543c833ba1cc0dfcb55eeaa1f65202eaa78496fd471671267de00258f931c14918ad1a7045af83f56e3ec5d21a431029bb35ee68f3f8411188bfc0"

// A key stored by the release before JSON was compared by value is
// compared as that release compared it: its retry with the same bytes is
// replayed, and another body, or the same JSON written another way, is
// another request (422), as it was before the upgrade. (It failed with 422
// for the same bytes when the new digest was written under the old
// version, and with another value replayed when the two versions were not
// compared.) A stored row that does not parse as
// version 4 is the same request as nothing.
func TestHTTPJSONRetryAcrossTheFingerprintUpgradeIsComparedAsBefore(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d", n)
	})))
	t.Cleanup(srv.Close)
	send := func(key, body string) mountedReply {
		req := mountedPost(t, srv.URL+"/v1/charges", "application/json", body)
		req.Host = "api.example"
		return do(t, srv.Client(), req, key)
	}
	old, err := hex.DecodeString(version4Row)
	require.NoError(t, err)
	const body = `{"amount_cents":100,"account_id":"acct-7"}`
	for i, c := range []struct {
		name, retry string
		row         []byte
		want        int
	}{
		{"the same bytes", body, old, http.StatusCreated},
		{"written another way, by its bytes as before", `{"account_id": "acct-7", "amount_cents": 100}`, old, http.StatusUnprocessableEntity},
		{"another value", `{"amount_cents":900,"account_id":"acct-7"}`, old, http.StatusUnprocessableEntity},
		{"a damaged version 4 row", body, append(bytes.Clone(old), 0), http.StatusUnprocessableEntity},
	} {
		key := fmt.Sprintf("k-v4-%d", i)
		first := send(key, body)
		require.Equal(t, http.StatusCreated, first.status, first.body)
		var stored []byte
		require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT fingerprint FROM idempotency_keys WHERE key LIKE '%'||$1`, key).Scan(&stored))
		require.Equal(t, old[5:5+32], stored[5:5+32], "the request's digest is version 4's")
		require.EqualValues(t, 6, stored[4], "stored as version 6")
		tag, err := db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET fingerprint = $1 WHERE key LIKE '%'||$2`, c.row, key)
		require.NoError(t, err)
		require.EqualValues(t, 1, tag.RowsAffected())
		r := send(key, c.retry)
		require.Equal(t, c.want, r.status, "%s: %s", c.name, r.body)
		if c.want == http.StatusCreated {
			require.Equal(t, first.body, r.body, c.name)
			require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader), c.name)
		}
		require.EqualValues(t, i+1, runs.Load(), "%s: one execution per key", c.name)
	}
}

// The canonical JSON fingerprint (httpjson.go). The rule: two
// requests a handler could tell apart are never one request (a replay of
// another request's response); two that differ only in whitespace, member
// order and string escapes are.

// jsonCharge is what a typical Go handler decodes: encoding/json
// matches the key "amount" to the field whatever its case ("Amount",
// "AMOUNT"), and the last member it meets wins.
type jsonCharge struct {
	Amount int64 `json:"amount"`
}

// chargeJSONServer serves a handler that decodes the body into jsonCharge
// with encoding/json and answers with the amount it charged.
func chargeJSONServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	db := suiteDB(t)
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		var c jsonCharge
		if err := json.NewDecoder(r.Body).Decode(&c); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d charged %d", n, c.Amount)
	})))
	t.Cleanup(srv.Close)
	return srv, &runs
}

// The canonical form sorts members by their key's exact bytes and keeps
// the order sent only among members of one exact key. encoding/json folds
// case when it matches a key to a struct field, so "amount" and "Amount"
// set the same field and the later one wins: {"amount":1,"Amount":500}
// charges 500, {"Amount":500,"amount":1} charges 1. Both canonicalise to
// {"Amount":500,"amount":1}: the second request is answered with the
// first's "charged 500" and its handler never runs.
func TestHTTPJSONCaseFoldedDuplicateKeysInAnotherOrderAreDifferentRequests(t *testing.T) {
	t.Parallel()
	first, second := `{"amount":1,"Amount":500}`, `{"Amount":500,"amount":1}`
	// What the handler reads from each, decoded here to show they differ.
	var a, b jsonCharge
	require.NoError(t, json.Unmarshal([]byte(first), &a))
	require.NoError(t, json.Unmarshal([]byte(second), &b))
	require.NotEqual(t, a.Amount, b.Amount, "the handler reads the two bodies differently")

	srv, runs := chargeJSONServer(t)
	r1 := sendJSON(t, srv, "k-fold", "application/json", first)
	require.Equal(t, http.StatusCreated, r1.status, r1.body)
	require.Equal(t, "run 1 charged 500", r1.body)
	r2 := sendJSON(t, srv, "k-fold", "application/json", second)
	require.NotEqual(t, "true", r2.header.Get(idempotency.ReplayedHeader),
		"a request the handler reads as charging 1 was answered with the stored response of one charging 500: %q", r2.body)
	require.Equal(t, http.StatusUnprocessableEntity, r2.status, r2.body)
	require.EqualValues(t, 1, runs.Load())
}

// The same with a folding beyond ASCII: encoding/json matches "ſ" (U+017F,
// long s) to a field named "s", as it matches "S".
func TestHTTPJSONUnicodeFoldedDuplicateKeysInAnotherOrderAreDifferentRequests(t *testing.T) {
	t.Parallel()
	type s struct {
		S int64 `json:"s"`
	}
	first, second := `{"s":1,"ſ":500}`, `{"ſ":500,"s":1}`
	var a, b s
	require.NoError(t, json.Unmarshal([]byte(first), &a))
	require.NoError(t, json.Unmarshal([]byte(second), &b))
	require.NotEqual(t, a.S, b.S, "the handler reads the two bodies differently")

	srv, runs := jsonServer(t)
	r1 := sendJSON(t, srv, "k-fold-u", "application/json", first)
	require.Equal(t, http.StatusCreated, r1.status, r1.body)
	r2 := sendJSON(t, srv, "k-fold-u", "application/json", second)
	require.NotEqual(t, "true", r2.header.Get(idempotency.ReplayedHeader), "replayed: %q", r2.body)
	require.Equal(t, http.StatusUnprocessableEntity, r2.status, r2.body)
	require.EqualValues(t, 1, runs.Load())
}

// A JSON body sent with a charset parameter other than UTF-8: the canonical
// form reads the raw bytes as UTF-8 and decodes escapes to UTF-8, so the
// raw bytes C3 A9 and the escape "\u00e9" count as one string (é). A
// handler that honours the declared charset, ISO-8859-1, reads the raw
// bytes as "Ã©" and the escape as "é": two requests it tells apart were
// one, and the second got the first's response. A JSON body in another
// charset than UTF-8 is compared by its bytes: the second is 422.
func TestHTTPJSONWithLatin1CharsetEscapesAreNotRawBytes(t *testing.T) {
	t.Parallel()
	const ct = "application/json; charset=iso-8859-1"
	first := `{"name":"caf` + "\xc3\xa9" + `"}` // raw bytes: in ISO-8859-1, "cafÃ©"
	second := `{"name":"caf\u00e9"}`            // an escape: "café" in any charset
	decode := func(body string) string {
		// ISO-8859-1: each byte is the code point of its value.
		var utf8Body []byte
		for _, c := range []byte(body) {
			utf8Body = utf8.AppendRune(utf8Body, rune(c))
		}
		var v struct{ Name string }
		require.NoError(t, json.Unmarshal(utf8Body, &v))
		return v.Name
	}
	require.Equal(t, "cafÃ©", decode(first))
	require.Equal(t, "café", decode(second))

	db := suiteDB(t)
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d named %q", n, decode(string(b)))
	})))
	t.Cleanup(srv.Close)
	r1 := sendJSON(t, srv, "k-latin1", ct, first)
	require.Equal(t, http.StatusCreated, r1.status, r1.body)
	r2 := sendJSON(t, srv, "k-latin1", ct, second)
	require.NotEqual(t, "true", r2.header.Get(idempotency.ReplayedHeader), "replayed %q for a request naming %q", r2.body, decode(second))
	require.Equal(t, http.StatusUnprocessableEntity, r2.status, "the key with another request")
	require.EqualValues(t, 1, runs.Load())
}

// What a handler tells apart and the canonical form must keep apart:
// Unicode normalisation forms, numbers written otherwise, a lone
// surrogate against U+FFFD, invalid UTF-8 against U+FFFD, a BOM, trailing
// garbage, a key of the object structure spelled as a string.
func TestHTTPJSONValuesAHandlerTellsApartAre422(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	cases := []struct{ first, other string }{
		{`{"n":"caf` + "\u00e9" + `"}`, `{"n":"cafe` + "\u0301" + `"}`}, // NFC vs NFD
		{`{"n":"caf\u00e9"}`, `{"n":"cafe\u0301"}`},
		{`{"n":0}`, `{"n":-0}`},
		{`{"n":1}`, `{"n":1e0}`},
		{`{"n":1E400}`, `{"n":1e400}`},
		{`{"n":"\ufffd"}`, `{"n":"\ud800"}`},
		{`{"n":"\ufffd"}`, `{"n":"` + "\xff" + `"}`},
		{`{"n":"\u0000"}`, `{"n":""}`},
		{`{"n":"a"}`, "\xef\xbb\xbf" + `{"n":"a"}`},
		{`{"n":"a"}`, `{"n":"a"}x`},
		{`{"n":"a"}`, `{"n":"a"}{}`},
		{`[{"a":"b"}]`, `[{"a":"b"},{}]`},
		{`{"a":[1,2]}`, `{"a":[12]}`},
		{`{"a":{"b":"c,d"}}`, `{"a":{"b":"c","d":null}}`},
		{`{"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa":1}`, `{"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa":[1]}`},
		{`{"k":{"x":"yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"}}`, `{"k":[{"x":"yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"}]}`},
		{`{"a":1,"a":2,"b":3}`, `{"a":2,"b":3,"a":1}`},
		{`{"a":"\"b\":1"}`, `{"a":"","b":1}`},
	}
	for i, c := range cases {
		key := fmt.Sprintf("k-apart-%d", i)
		r1 := sendJSON(t, srv, key, "application/json", c.first)
		require.Equal(t, http.StatusCreated, r1.status, r1.body)
		r := sendJSON(t, srv, key, "application/json", c.other)
		require.Equal(t, http.StatusUnprocessableEntity, r.status, "%q after %q: %s", c.other, c.first, r.body)
	}
	require.EqualValues(t, len(cases), runs.Load())
}

// Bodies that differ only as the rule allows replay, deep nesting and
// structured-suffix types with parameters included.
func TestHTTPJSONDeepEscapedOrSuffixTypedRetryIsReplayed(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	deep := func(n int, sep string) string {
		return string(bytes.Repeat([]byte("["+sep), n)) + "1" + string(bytes.Repeat([]byte(sep+"]"), n))
	}
	cases := []struct{ ct, first, other string }{
		{"application/problem+json", `{"type":"about:blank","title":"x"}`, `{ "title" : "x" , "type" : "about:blank" }`},
		{"application/json; charset=utf-8", `{"a":"\/"}`, `{"a":"/"}`},
		{"application/json", deep(9000, ""), deep(9000, " ")},
		{"application/json", `{"a":"\u00E9\uD83D\uDE00"}`, `{"a":"é😀"}`},
		{"application/json", `{"z":{"y":[1,{"q":"rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr","p":2}]},"a":1}`, `{"a":1,"z":{"y":[1,{"p":2,"q":"rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr"}]}}`},
	}
	for i, c := range cases {
		key := fmt.Sprintf("k-same-%d", i)
		r1 := sendJSON(t, srv, key, c.ct, c.first)
		require.Equal(t, http.StatusCreated, r1.status, r1.body)
		r := sendJSON(t, srv, key, c.ct, c.other)
		require.Equal(t, http.StatusCreated, r.status, "%d: %s", i, r.body)
		require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader), "%d", i)
	}
	require.EqualValues(t, len(cases), runs.Load())
}

// A JSON body under a charset other than UTF-8 is compared by its bytes:
// read in ISO-8859-1, the bytes C3 A9 are "Ã©", not the "é" that "\u00e9"
// is. RFC 9110 reads a Content-Type's charset where Go's mime package
// refuses the whole list of parameters (an empty parameter, which RFC
// 9110 allows), and so does a handler that reads it so.
func TestHTTPJSONUnderAnotherCharsetIsComparedByItsBytes(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	for i, contentType := range []string{
		"application/json; charset=iso-8859-1",
		"application/json; charset=iso-8859-1;;",
		"application/json;; charset=iso-8859-1",
		"application/json; charset=iso-8859-1; ;",
	} {
		key := fmt.Sprintf("k-charset-%d", i)
		first := sendJSON(t, srv, key, contentType, "{\"note\":\"\xc3\xa9\"}")
		require.Equal(t, http.StatusCreated, first.status, "%s: %s", contentType, first.body)
		r := sendJSON(t, srv, key, contentType, `{"note":"\u00e9"}`)
		require.Equal(t, http.StatusUnprocessableEntity, r.status, "%s: another value in ISO-8859-1, replayed: %s", contentType, r.body)
		require.EqualValues(t, i+1, runs.Load(), "%s: one execution per key", contentType)
	}
}
