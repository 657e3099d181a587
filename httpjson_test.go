package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// canonicalText runs the canonicalisation and returns its text, and
// whether the output buffer kept the body's length as its capacity (the
// text is never longer than the body).
func canonicalText(body []byte) (text []byte, ok, inPlace bool) {
	if len(body) == 0 {
		return nil, false, true
	}
	c := jsonCanon{in: body, out: make([]byte, 0, len(body))}
	ok = c.run()
	return c.out, ok, cap(c.out) == len(body)
}

// The canonical form drops what no decoder sees (whitespace, the order of
// keys, the escaping of a string) and keeps the rest: a number's literal,
// duplicate keys in their order, a key's spelling. Bodies that are not one
// JSON value, or that hold what encoding/json would read as U+FFFD, are
// not canonical (the fingerprint falls back to their bytes).
func TestJSONDigestSameAndDifferent(t *testing.T) {
	t.Parallel()
	same := [][2]string{
		{`{"a":1,"b":[true,false,null]}`, ` { "b" : [ true , false , null ] , "a" : 1 } ` + "\n"},
		{`{"a":1,"b":2}`, "{\"a\":1,\r\n\t\"b\":2}"},
		{`{"amount_cents":"100","account_id":"acct-7"}`, `{"account_id":"acct-7", "amount_cents":"100"}`}, // protojson's random space
		{`"é"`, `"\u00e9"`},
		{`"é"`, `"\u00E9"`},
		{`"/"`, `"\/"`},
		{`"😀"`, `"\ud83d\ude00"`},
		{`"\n"`, `"\u000a"`},
		{`"\u001f"`, `"\u001F"`},
		{`"\""`, `"\u0022"`},
		{`{"é":1,"e":2}`, `{"e":2,"\u00e9":1}`},
		{`{"a":{"y":1,"x":[1,{"q":2,"p":3}]}}`, `{"a":{"x":[1,{"p":3,"q":2}],"y":1}}`},
		{`{"a":1,"a":2,"b":0}`, `{"b":0,"a":1,"a":2}`},
		{`[]`, `[ ]`},
		{`{}`, `{ }`},
		{`1e999999999`, ` 1e999999999 `},
		{`{"k":"` + strings.Repeat("x", 100) + `","j":1}`, `{"j":1,"k":"` + strings.Repeat("x", 100) + `"}`},
	}
	for _, c := range same {
		a, aok := jsonDigest([]byte(c[0]))
		b, bok := jsonDigest([]byte(c[1]))
		require.True(t, aok && bok, "%s / %s: both canonical", c[0], c[1])
		require.Equal(t, a, b, "%s and %s are one request", c[0], c[1])
	}
	different := [][2]string{
		{`1`, `1.0`},
		{`1`, `1e0`},
		{`0`, `-0`},
		{`1e2`, `1E2`},
		{`100`, `1e2`},
		{`9007199254740993`, `9007199254740992`}, // one float64, two int64s
		{`{"a":1,"a":2}`, `{"a":2,"a":1}`},
		{`{"a":1,"a":2}`, `{"a":2}`},
		{`{"Amount":1}`, `{"amount":1}`},
		{`["a","b"]`, `["b","a"]`},
		{`{"a":[1,2]}`, `{"a":[2,1]}`},
		{`"a"`, `["a"]`},
		{`{"a":"b"}`, `{"a":["b"]}`},
		{`null`, `"null"`},
		{`{"a":1}`, `{"a":"1"}`},
		{`"\u0000"`, `""`},
		{`[{"a":1},{"b":2}]`, `[{"a":1,"b":2}]`},
		{`{"ab":1}`, `{"a":1,"b":1}`},
	}
	for _, c := range different {
		a, aok := jsonDigest([]byte(c[0]))
		b, bok := jsonDigest([]byte(c[1]))
		require.True(t, aok && bok, "%s / %s: both canonical", c[0], c[1])
		require.NotEqual(t, a, b, "%s and %s are two requests", c[0], c[1])
	}
	for _, body := range []string{
		``, ` `, `{`, `}`, `{"a":1,}`, `[1,]`, `{"a" 1}`, `{a:1}`, `01`, `1.`, `.1`, `-`, `1e`, `+1`,
		`tru`, `nul`, `"abc`, "\"a\x01\"", `"\x"`, `"\u12"`, `"\u12g4"`,
		`1 2`, `{} {}`, `{"a":1}x`, "\xef\xbb\xbf{}", // a byte order mark
		"\"\xff\"", "\"\xed\xa0\x80\"", // not UTF-8; a surrogate in UTF-8
		`"\ud800"`, `"\udc00"`, `"\ud800\u0041"`, `"\ud800x"`, `"\udc00\ud800"`,
		strings.Repeat("[", maxJSONDepth+1) + strings.Repeat("]", maxJSONDepth+1),
	} {
		_, ok := jsonDigest([]byte(body))
		require.False(t, ok, "%.80q is not canonical", body)
	}
	deepest := strings.Repeat(`{"a":[`, maxJSONDepth/2-1) + `{"a":[]}` + strings.Repeat("]}", maxJSONDepth/2-1)
	require.True(t, json.Valid([]byte(deepest)), "sanity: encoding/json reads it")
	_, ok := jsonDigest([]byte(deepest))
	require.True(t, ok, "nesting as deep as encoding/json reads is canonical")
	tooDeep := "[" + deepest + "]"
	require.False(t, json.Valid([]byte(tooDeep)), "sanity: encoding/json refuses it")
	_, ok = jsonDigest([]byte(tooDeep))
	require.False(t, ok, "nesting deeper than encoding/json reads is compared by its bytes")
}

// FuzzJSONDigest checks the canonical form against encoding/json: two
// bodies with one canonical digest decode to the same value (with
// json.Number, so a number counts as its literal), a body re-encoded by
// encoding/json (no whitespace, keys sorted, strings escaped its way) or
// indented keeps its digest, what is canonical is valid JSON, and the
// text is never longer than the body.
func FuzzJSONDigest(f *testing.F) {
	for _, s := range []string{
		`{"b":[1,2,{"y":null,"x":true}],"a":"\u00e9\n"}`,
		`{"a":1,"a":2}`, `[1.0,-0,1e5,1E+5]`, `"\ud83d\ude00<>&"`, `{}`, `[]`, `0`,
		`{"k":"` + strings.Repeat("v", 40) + `","j":[` + strings.Repeat(`{"z":1,"y":2},`, 5) + `0]}`,
		"\"\xff\"", `"\ud800"`, `[[[[[[[[[[]]]]]]]]]]`,
	} {
		f.Add([]byte(s), []byte(" "+s+"\n"))
	}
	f.Fuzz(func(t *testing.T, a, b []byte) {
		da, aok := jsonDigest(a)
		db, bok := jsonDigest(b)
		for _, in := range [][]byte{a, b} {
			text, ok, inPlace := canonicalText(in)
			if !ok {
				continue
			}
			if !json.Valid(in) {
				t.Fatalf("%q is canonical but not valid JSON", in)
			}
			if !inPlace || len(text) > len(in) {
				t.Fatalf("%q: the canonical text (%d bytes) outgrew the body", in, len(text))
			}
			// Re-encoded by encoding/json, when that is the same value:
			// every string UTF-8 (else it writes U+FFFD) and no key twice
			// (else it keeps the last).
			if v, err := decodeJSON(in); err == nil && !hasDuplicateKey(in) {
				re, err := json.Marshal(v)
				if err != nil {
					t.Fatal(err)
				}
				if d, ok := jsonDigest(re); !ok || d != mustDigest(t, in) {
					t.Fatalf("%q and its re-encoding %q: not one request", in, re)
				}
			}
			var indented bytes.Buffer
			if err := json.Indent(&indented, in, "", "  "); err == nil {
				if d, ok := jsonDigest(indented.Bytes()); !ok || d != mustDigest(t, in) {
					t.Fatalf("%q indented: not one request", in)
				}
			}
		}
		if aok && bok && da == db {
			va, erra := decodeJSON(a)
			vb, errb := decodeJSON(b)
			if erra != nil || errb != nil || !reflect.DeepEqual(va, vb) {
				t.Fatalf("%q and %q are one request to the fingerprint but not to encoding/json", a, b)
			}
		}
	})
}

func mustDigest(t *testing.T, b []byte) [sha256.Size]byte {
	d, ok := jsonDigest(b)
	if !ok {
		t.Fatalf("%q: not canonical", b)
	}
	return d
}

func decodeJSON(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("more after the value")
	}
	return v, nil
}

// hasDuplicateKey reports whether an object in b (valid JSON) has a key
// twice, or a string that is not UTF-8 (encoding/json would change it).
func hasDuplicateKey(b []byte) bool {
	if !utf8.Valid(b) || bytes.Contains(b, []byte(`\ud`)) || bytes.Contains(b, []byte(`\uD`)) {
		return true // a surrogate escape: let the other checks speak
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	type level struct {
		keys      map[string]bool // nil for an array
		expectKey bool
	}
	var stack []*level
	valueDone := func() {
		if len(stack) > 0 && stack[len(stack)-1].keys != nil {
			stack[len(stack)-1].expectKey = true
		}
	}
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		if n := len(stack); n > 0 && stack[n-1].keys != nil && stack[n-1].expectKey {
			top := stack[n-1]
			if tok == json.Delim('}') {
				stack = stack[:n-1]
				valueDone()
				continue
			}
			k := tok.(string)
			if top.keys[k] {
				return true
			}
			top.keys[k], top.expectKey = true, false
			continue
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, &level{keys: map[string]bool{}, expectKey: true})
		case json.Delim('['):
			stack = append(stack, &level{})
		case json.Delim(']'):
			stack = stack[:len(stack)-1]
			valueDone()
		default:
			valueDone()
		}
	}
}

// BenchmarkJSONDigest measures a 1 MiB body (WithHTTPMaxRequestBytes's
// default) of several shapes: what the canonical digest allocates against
// the body's size, next to the digest of the bytes and to encoding/json
// decoding the body into an any.
func BenchmarkJSONDigest(b *testing.B) {
	const size = 1 << 20
	fill := func(unit func(i int) string, open, sep, close string) []byte {
		var buf bytes.Buffer
		buf.WriteString(open)
		for i := 0; ; i++ {
			u := unit(i)
			if buf.Len()+len(u)+len(sep)+len(close) > size {
				break
			}
			if i > 0 {
				buf.WriteString(sep)
			}
			buf.WriteString(u)
		}
		buf.WriteString(close)
		return buf.Bytes()
	}
	shapes := []struct {
		name string
		body []byte
	}{
		{"records", fill(func(i int) string {
			return fmt.Sprintf(`{"id":"ch_%08d","account_id":"acct-%d","amount_cents":%d,"currency":"EUR","tags":["a","b"],"paid":true}`, i, i%97, i*7)
		}, "[", ", ", "]")},
		{"flat_object_tiny_members", fill(func(i int) string { return fmt.Sprintf(`"%x":0`, i) }, "{", ",", "}")},
		{"flat_object_smallest_members", fill(func(int) string { return `"":0` }, "{", ",", "}")}, // the most members a body holds
		{"array_of_small_numbers", fill(func(int) string { return "0" }, "[", ",", "]")},
		{"array_of_empty_objects", fill(func(int) string { return "{}" }, "[", ",", "]")},
		{"long_string", []byte(`"` + strings.Repeat("é", (size-2)/2) + `"`)},
		{"nested_to_the_limit", []byte(strings.Repeat(`{"a":[`, maxJSONDepth/2) + strings.Repeat("]}", maxJSONDepth/2))},
	}
	for _, s := range shapes {
		if _, ok := jsonDigest(s.body); !ok {
			b.Fatalf("%s: not canonical", s.name)
		}
		b.Run(s.name+"/canonical", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(s.body)))
			for b.Loop() {
				jsonDigest(s.body)
			}
		})
		b.Run(s.name+"/bytes", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(s.body)))
			for b.Loop() {
				sha256.Sum256(s.body)
			}
		})
		b.Run(s.name+"/encoding_json_any", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(s.body)))
			for b.Loop() {
				_, _ = decodeJSON(s.body)
			}
		})
	}
}
